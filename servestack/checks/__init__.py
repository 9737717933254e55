"""The verification checks: what they read of a host and how they judge it.

The same checks serve the testinfra suite (tests/verify, `servestack verify`) and the deploy's
last step (operations/verify.py). A check needing hardware the host lacks is SKIPPED with the
fact that says so; it never passes silently.

    catalogue.py   every check: its name, what it reads, its judge; `judge_all`
    readings.py    what the checks read of a host, by group (facts), and `Readings`, what was read
    outcome.py     `Outcome` (passed, failed, skipped) and the `Fail` / `Skip` a judge raises
    parse.py       the python probes' report lines, the sample's results, versions
    gpus.py        what the GPUs must be: one judgement for preflight and the GPU checks
    toolkit.py     the toolkit checks: nvcc, version.json, the link, the kept toolkits, the CUDA sample
    release.py     the release checks: package versions, torch on the GPUs, SGLang, the patches
    service.py     the service checks: unit, user, environment, secrets, /health, /generate

The host-side scripts are files/scripts/verify-*.sh and verify-*.py (facts/verify.py runs them).
"""
