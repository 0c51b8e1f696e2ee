"""The charset task's hint: its scoring replayed on a reply, said as one imperative sentence
that names what cost points (the kinds of characters outside the set, or a reply too short) and
shows a reply with full marks ("Reply in CAPITAL LETTERS only, without lowercase letters or
spaces, for example: HELLOWORLD"). The wording is measured: SmolLM2-135M-Instruct, 24 samples
after the hint as a second user message, scores 0.33-0.41 with it against 0.08-0.12 without a
hint, but only 0.16 with "Your reply used characters that are not allowed: ... Reply in CAPITAL
LETTERS only, ..." (it echoes "Your reply ..."); docs/distillation.md."""

from __future__ import annotations

import string

from deltarl.env_server.charset.environment import CharsetRules, score_reply

_EXAMPLES = ("HELLOWORLD", "helloworld", "GOODMORNING", "goodmorning", "0123456789")


def _kinds(chars: set[str]) -> list[str]:
    """Names for the kinds of characters in ``chars``, e.g. ["lowercase letters", "spaces"]."""
    kinds = [
        ("lowercase letters", str.islower),
        ("capital letters", str.isupper),
        ("digits", str.isdigit),
        ("spaces", lambda c: c == " "),
        ("line breaks", lambda c: c in "\r\n"),
    ]
    names, left = [], set(chars)
    for name, test in kinds:
        hit = {c for c in left if test(c)}
        if hit:
            names.append(name)
            left -= hit
    if left:
        shown = " ".join(sorted(left)[:8])
        names.append(f"other characters ({shown})")
    return names


def _allowed(rules: CharsetRules) -> tuple[str, str]:
    """(how to say the target set, an example reply that scores 1.0)."""
    target = set(rules.target)
    example = next((w for w in _EXAMPLES if set(w) <= target and len(w) >= rules.min_chars), None)
    if example is None:
        ordered = "".join(dict.fromkeys(rules.target))
        example = (ordered * rules.min_chars)[: max(rules.min_chars, len(ordered))]
    if target == set(string.ascii_uppercase):
        return "CAPITAL LETTERS only", example
    if target == set(string.ascii_lowercase):
        return "lowercase letters only", example
    return f"only these characters: {rules.target}", example


def charset_hint(reply: str, rules: CharsetRules) -> str | None:
    """The hint for ``reply`` under ``rules``; None at full marks. Also the wording of the
    synthetic hint-following transcripts (:mod:`deltarl.env_server.charset.transcripts`)."""
    reward, _ = score_reply(reply, rules)
    if reward >= 1.0:
        return None
    allowed, example = _allowed(rules)
    bad = set(reply) - set(rules.target)
    if bad:
        kinds = _kinds(bad)
        said = ", ".join(kinds[:-1]) + " or " + kinds[-1] if len(kinds) > 1 else kinds[0]
        return f"Reply in {allowed}, without {said}, for example: {example}"
    return f"Reply with at least {rules.min_chars} characters, in {allowed}, for example: {example}"
