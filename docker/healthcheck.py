"""Container health check (standard library only: the slim images have no curl).

    python /opt/deltarl/healthcheck.py http://127.0.0.1:8700/health [--tls-env VAR]
    python /opt/deltarl/healthcheck.py --url-env VAR [--path /health]

Exit status 0 when the URL answers 200 within 4 s, else 1 (Docker's convention); an error
answer's status and the start of its body are printed (``docker inspect`` keeps them).

* Services check their own ``/health`` on loopback: the coordinator (8700), the env server
  (8001) and the rollout worker (8702: 200 only while its weights are verified, 503 with the
  reason while it starts, i.e. before the trainer's first version reached it, or while its
  weights are unhealthy). ``--tls-env VAR``: when the environment variable VAR is set (the
  service's ``..._TLS_CERTFILE``), the service serves HTTPS and the check uses ``https://``
  instead; the certificate is not verified, since this only asks whether the local process
  answers.
* The trainer serves no HTTP. ``--url-env VAR`` reads the coordinator's base URL from VAR
  (``DELTARL_TRAINER_COORDINATOR_URL``) and checks that its ``/health`` answers from this
  container, verifying its certificate with ``DELTARL_CA_BUNDLE`` (or
  ``DELTARL_ROLLOUT_CA_BUNDLE``) when set: a trainer cut off from its coordinator is reported
  unhealthy. (That the trainer process itself runs, Docker knows: it is the container's main
  process.)
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 4.0
BODY_CHARS = 300  # of an error answer, in the message


def check(url: str, verify: bool, cafile: str | None) -> str | None:
    """None if ``url`` answers 200, else why not."""
    if verify:
        context = ssl.create_default_context(cafile=cafile)
    else:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S, context=context) as response:
            if response.status != 200:
                return f"{url}: HTTP {response.status}"
    except urllib.error.HTTPError as exc:  # 4xx/5xx: say why (the worker's 503 names a reason)
        body = exc.read(BODY_CHARS).decode(errors="replace").strip()
        return f"{url}: HTTP {exc.code} {body}".rstrip()
    except Exception as exc:  # any failure means unhealthy; say which
        return f"{url}: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", nargs="?", help="URL to check (a service's own /health).")
    parser.add_argument("--tls-env", help="Use https:// when this variable is set.")
    parser.add_argument("--url-env", help="Read the base URL from this variable instead.")
    parser.add_argument("--path", default="/health", help="Path under --url-env's base URL.")
    args = parser.parse_args(argv)
    if args.url_env:
        base = os.environ.get(args.url_env)
        if not base:
            print(f"unhealthy: {args.url_env} is not set", file=sys.stderr)
            return 1
        url = base.rstrip("/") + args.path
        cafile = os.environ.get("DELTARL_ROLLOUT_CA_BUNDLE") or os.environ.get("DELTARL_CA_BUNDLE")
        verify = True
    elif args.url:
        url, cafile, verify = args.url, None, False
        if args.tls_env and os.environ.get(args.tls_env) and url.startswith("http://"):
            url = "https://" + url.removeprefix("http://")
    else:
        parser.error("give a URL or --url-env")
    problem = check(url, verify, cafile or None)
    if problem is not None:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
