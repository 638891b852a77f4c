"""The soak and fault suite: real workers and a real gateway under a mixed load while faults are injected.

    python -m soak --minutes 30            the soak: faults in turn until the time is up, a report at the end
    python -m soak --short                 each fault once under load (what CI runs, through tests/soak)

- :mod:`soak.stack`: the workers, the gateway process and the store it runs against (all on loopback).
- :mod:`soak.load`: the mixed load, its outcomes, and the answer checks against plain SGLang.
- :mod:`soak.faults`: the faults and the checks after each.
- :mod:`soak.run`: one soak, its accounting and its report (JSON and Markdown).
- :mod:`soak.store_check`: whether the store opens and what its entries read as, in a process of its own.
"""
