"""The public API as a type checker sees it: real types for every name of ``recsys_dist``
(``py.typed`` ships), checked with mypy on examples/ and a typed user script, and a wrong call
reported, so the check cannot pass with everything ``Any``."""

import re
import subprocess
import sys
import textwrap

from tests.unit.api.test_typing import ROOT


def test_mypy_checks_examples_and_user_code_against_real_types(tmp_path):
    """mypy (pinned in the test extras; pyproject's [tool.mypy]) on examples/, tests/e2e/api/typed_user.py
    and, outside the repository, a script with one wrong use of the API a line: each is reported,
    and nothing else is. ``fit()`` is a ``FitSummary`` TypedDict, ``evaluate()`` a
    ``dict[str, float]``, ``launch`` a ``list`` of ``fn``'s return type with ``args`` checked
    against ``fn``."""
    wrong = tmp_path / "wrong_user.py"
    wrong.write_text(
        textwrap.dedent(
            """\
            import recsys_dist

            cfg = recsys_dist.load_config(3)
            trainer = recsys_dist.Trainer(cfg, run_dir=["runs"])
            step: str = trainer.step
            recsys_dist.save_checkpoint("runs", trainer.model, step="7")
            recsys_dist.no_such_name
            spec = recsys_dist.feature_spec(cfg)
            spec.no_such_field
            trainer.fit()["no_such_key"]
            auc: str = trainer.evaluate("test")["auc"]
            steps: str = trainer.fit()["steps"]
            def job(config: str) -> float: return 1.0
            names: list[str] = recsys_dist.launch(job, 2, "configs/x.yaml")
            recsys_dist.launch(job, 2, 3)
            """
        )
    )
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
        + ["--cache-dir", str(tmp_path / "cache"), "--no-error-summary", "--hide-error-context"]
        + [str(ROOT / "examples"), str(ROOT / "tests" / "e2e" / "api" / "typed_user.py"), wrong.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    errors = [ln for ln in r.stdout.splitlines() if ": error:" in ln]
    assert all(ln.startswith("wrong_user.py:") for ln in errors), r.stdout + r.stderr  # mypy prints it from cwd
    lines = {int(re.match(r".*?:(\d+):", ln).group(1)): ln for ln in errors}
    assert sorted(lines) == [3, 4, 5, 6, 7, 9, 10, 11, 12, 14, 15], r.stdout + r.stderr
    assert '"load_config" has incompatible type "int"' in lines[3]
    assert '"run_dir" to "Trainer" has incompatible type "list[str]"' in lines[4]
    assert 'expression has type "int", variable has type "str"' in lines[5]
    assert '"step" to "save_checkpoint" has incompatible type "str"; expected "int"' in lines[6]
    assert 'Module has no attribute "no_such_name"' in lines[7]
    assert '"FeatureSpec" has no attribute "no_such_field"' in lines[9]
    # What Trainer.fit / evaluate and launch return, and what launch passes (typed: they were dict / list[Any]).
    assert 'TypedDict "FitSummary" has no key "no_such_key"' in lines[10]
    assert 'expression has type "float", variable has type "str"' in lines[11]
    assert 'expression has type "int", variable has type "str"' in lines[12]
    assert '"launch" has incompatible type "Callable[[str], float]"; expected "Callable[[str], str]"' in lines[14]
    assert '"launch" has incompatible type "Callable[[str], float]"; expected "Callable[[int], float]"' in lines[15]
    assert r.returncode == 1
