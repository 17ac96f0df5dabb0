"""Every spec in cluster_examples/ is valid and plans the roles it says it has."""

from __future__ import annotations

from pathlib import Path

import pytest

from psctl.spec import load_spec, make_plan

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "cluster_examples").glob("*.yaml"))


def test_there_are_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {"local.yaml", "sync.yaml", "bounded.yaml", "embedding.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid_and_plans(path: Path) -> None:
    spec = load_spec(path)
    plan = make_plan(spec, check_ports=False)
    names = plan.names()
    assert names[0] == "chief-0"
    assert sum(n.startswith("ps-") for n in names) == spec.roles["ps"].replicas
    assert sum(n.startswith("worker-") for n in names) == spec.roles["worker"].replicas
    assert spec.training["steps"] > 0
    if spec.training.get("mode") == "sync":
        assert spec.training["replicas_to_aggregate"] <= spec.training["total_replicas"]
