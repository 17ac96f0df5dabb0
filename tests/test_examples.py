"""Every spec in cluster_examples/ is valid and plans the roles it says it has; the README's own program is a
correct one (its gradients are its loss's) and its spec is valid."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import readme_files

from psctl.runtime.program import ProgramRef, VariableDef, load_program
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


def test_the_readme_program_computes_its_loss_s_gradients_and_its_spec_is_valid(tmp_path: Path) -> None:
    """README, "Your own program": the program and the spec, as written there (test_e2e_local trains them)."""
    files = readme_files("Your own program")
    assert sorted(files) == ["my_model.py", "spec.yaml"]
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    spec = load_spec(tmp_path / "spec.yaml")
    assert make_plan(spec, check_ports=False).names() == ["chief-0", "ps-0", "worker-0", "worker-1"]
    t = spec.training
    program = load_program(ProgramRef(t["program"], t["args"], t["data"], t["seed"]))
    assert all(isinstance(v, VariableDef) for v in program.variables())
    batch = program.dataset("train", 0, 2).batch(0, 8)
    rng = np.random.default_rng(0)
    params = {v.name: rng.normal(size=v.shape) for v in program.variables()}  # float64: exact enough to compare
    loss, grads = program.loss_and_grads(params, batch)
    penalty = 0.5 * t["args"]["l2"] * (params["w"] ** 2).sum()
    assert loss == pytest.approx(program.evaluate(params, batch)["loss"] + penalty)
    for name, value in params.items():
        for index in [(0,) * value.ndim, tuple(n - 1 for n in value.shape)]:
            step = np.zeros_like(value)
            step[index] = 1e-6
            up = program.loss_and_grads({**params, name: value + step}, batch)[0]
            down = program.loss_and_grads({**params, name: value - step}, batch)[0]
            assert grads[name][index] == pytest.approx((up - down) / 2e-6, rel=1e-4, abs=1e-7), (name, index)
    assert program.embedding_ids(batch) == {}
    first, again = (program.dataset("train", 0, 2).batch(3, 8) for _ in range(2))
    assert all(np.array_equal(first[key], again[key]) for key in first)  # the same batch for the same position
