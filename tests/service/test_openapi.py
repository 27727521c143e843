"""The OpenAPI schema is truthful: schemathesis (all its checks, schema-valid and
schema-invalid requests, a bounded number of examples of each per operation) against
a real router process in front of a fake worker.

The router runs with an admin key the generated requests do not carry: the admin
routes are exercised on their 401 answers, so that no generated worker URL is ever
added and probed (no traffic beyond loopback). Operations are driven from one test
with hypothesis directly (schemathesis' pytest plugin does not load on this pytest)."""

from __future__ import annotations

from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from kvroute.eval.procs import Server
from support import start_fake_worker, start_router

EXAMPLES = 25


def test_router_keeps_to_its_schema(tmp_path: Path, processes: list[Server]) -> None:
    worker = start_fake_worker(tmp_path)
    processes.append(worker)
    router = start_router([worker.url], tmp_path, "--admin-api-key", "not-sent")
    processes.append(router)
    schema = schemathesis.openapi.from_url(router.url + "/openapi.json")
    failures: dict[str, str] = {}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12
    runs = [(op, mode) for op in operations for mode in schemathesis.GenerationMode]
    for operation, mode in runs:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def check(case: schemathesis.Case) -> None:
            case.call_and_validate(timeout=30)

        try:
            check()
        except Unsatisfiable:
            assert mode is schemathesis.GenerationMode.NEGATIVE  # no input to get wrong
        except BaseException as e:  # schemathesis' FailureGroup: collect each operation's
            if isinstance(e, KeyboardInterrupt):
                raise
            failures[f"{operation.label} ({mode.value})"] = str(e)[:3000]
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())
