"""Paths a spec names stay inside the spec's folder unless its user allows another folder (issue: hostile
specs must not make roles read or write elsewhere)."""

from __future__ import annotations

from pathlib import Path

import pytest

from psctl.errors import SpecError
from psctl.spec import load_spec

BASE = """\
roles: {{chief: {{}}, ps: {{replicas: 1}}, worker: {{replicas: 1}}}}
training:
  program: {program}
  data: {data}
  steps: 10
  checkpoint: {{dir: {ckpt}}}
{security}"""


def write_spec(folder: Path, *, program: str = "psctl.models.mlp", data: str = "{name: digits}",
               ckpt: str = "checkpoints", security: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cluster.yaml"
    path.write_text(BASE.format(program=program, data=data, ckpt=ckpt, security=security))
    return path


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "prog.py").write_text("def build(args, data, seed):\n    raise SystemExit\n")
    (other / "train.npz").write_bytes(b"")
    return other


@pytest.mark.parametrize(
    ("field", "kwargs", "line", "key", "what", "target", "allow"),
    [
        ("program", {"program": "../elsewhere/prog.py"}, 3, "training.program", "program file", "prog.py",
         "its folder"),
        ("data", {"data": "{path: ../elsewhere/train.npz}"}, 4, "training.data.path", "data path", "train.npz",
         "its folder"),
        # a folder is allowed itself, not its parent (for /etc that would be all of /)
        ("checkpoint", {"ckpt": "../elsewhere/ckpts"}, 6, "training.checkpoint.dir", "checkpoint folder", "ckpts",
         "it"),
    ],
)
def test_a_path_outside_the_spec_folder_is_refused_with_the_fix(
    tmp_path: Path, outside: Path, field: str, kwargs: dict[str, str], line: int, key: str, what: str, target: str,
    allow: str,
) -> None:
    spec_dir = tmp_path / "spec"
    path = write_spec(spec_dir, **kwargs)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    resolved = (outside / target).resolve()
    allowed = resolved if allow == "it" else resolved.parent
    assert err.value.exit_code == 2
    assert err.value.format_message() == (
        f"{path}:{line}: {key}: {what} {resolved} is outside the spec's folder ({spec_dir.absolute()}); "
        f"move it there, or allow {allow} with security: {{allowed_paths: [{allowed}]}}"
    )


def test_allowed_paths_let_the_user_say_so(tmp_path: Path, outside: Path) -> None:
    path = write_spec(
        tmp_path / "spec",
        program="../elsewhere/prog.py",
        data="{path: ../elsewhere/train.npz}",
        ckpt="../elsewhere/ckpts",
        security="security: {allowed_paths: [../elsewhere]}\n",
    )
    spec = load_spec(path)
    assert spec.training["program"] == str((outside / "prog.py").resolve())
    assert spec.security.allowed_paths == (str(outside.resolve()),)


def test_paths_inside_the_spec_folder_and_checkpoints_under_psctl_home_are_fine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("PSCTL_HOME", str(home))
    folder = tmp_path / "spec"
    (folder / "models").mkdir(parents=True)
    (folder / "models" / "mine.py").write_text("def build(args, data, seed):\n    raise SystemExit\n")
    spec = load_spec(write_spec(folder, program="models/mine.py", ckpt=str(home / "x" / "checkpoints")))
    assert spec.training["checkpoint"]["dir"] == str(home / "x" / "checkpoints")


def test_a_symlink_out_of_the_folder_does_not_get_around_it(tmp_path: Path, outside: Path) -> None:
    folder = tmp_path / "spec"
    folder.mkdir()
    (folder / "link.py").symlink_to(outside / "prog.py")
    with pytest.raises(SpecError, match="is outside the spec's folder"):
        load_spec(write_spec(folder, program="link.py"))
