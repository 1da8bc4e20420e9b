"""recsys_dist.cli.report on synthetic run directories written here (no training)."""

import pytest

from recsys_dist.cli import main as cli
from tests.unit.cli.test_report import make_run


@pytest.mark.parametrize("which", ["dir", "metrics"])
def test_cli_missing_run_dir_or_metrics_exits_2_naming_it(tmp_path, capsys, which):
    target = tmp_path / "nope"
    if which == "metrics":
        target.mkdir()
    good = make_run(tmp_path / "good")
    for argv in (["report", str(target)], ["compare", str(good), str(target)], ["compare", str(target), str(good)]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        named = str(target / "metrics.jsonl") if which == "metrics" else f"run directory {target} does not exist"
        assert named in err


def test_cli_report_and_compare_exit_0(tmp_path, capsys):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    assert cli.main(["report", str(a), "--no-plots"]) == 0
    assert "validation" in capsys.readouterr().out
    assert cli.main(["compare", str(a), str(b)]) == 0
    assert "config: identical" in capsys.readouterr().out


def test_unwritable_plot_dir_exits_1(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the plot directory should be
    assert cli.main(["report", str(run), "--out", str(blocker / "sub")]) == 1
    assert "cannot write plots" in capsys.readouterr().err


def test_recsys_dist_cli_runs_report_and_compare(tmp_path, capsys):
    """Through recsys_dist.cli.main.main: report and compare are its subcommands."""
    run = make_run(tmp_path / "run")
    try:
        cli.build_parser().parse_args(["report", str(run)])
    except SystemExit:
        pytest.fail("`recsys-dist report` is not a subcommand")
    capsys.readouterr()
    assert cli.main(["report", str(run), "--no-plots"]) == 0
    assert cli.main(["compare", str(run), str(run)]) == 0
    assert cli.main(["report", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
