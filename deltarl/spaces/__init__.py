"""Deploy deltarl's services as Hugging Face Docker Spaces (``deltarl spaces``, docs/spaces.md).

* :mod:`.names`: validation of namespaces, Space and bucket names; the ``*.hf.space`` URL rule;
* :mod:`.tokens`: the deployment's tokens and the local 0600 file that keeps them;
* :mod:`.templates`: each Space's README front matter, Dockerfile and source snapshot;
* :mod:`.variables`: the variables each service reads, from its settings classes;
* :mod:`.deploy`: the ordered Hub calls (real or dry run), recorded with secrets redacted;
* :mod:`.worker_space`: the rollout Space's entry point (the worker behind a health port that
  reports the worker's own ``/health``);
* :mod:`.cli`: ``deltarl spaces deploy | pause | delete | worker``.
"""
