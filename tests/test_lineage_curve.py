"""scripts/research/lineage_curve.py: point parsing, the per-doubling fit and reading a draft folder out of git
history."""

import importlib.util
import math
import pathlib
import subprocess

import pytest

_spec = importlib.util.spec_from_file_location(
    "lineage_curve", pathlib.Path(__file__).parents[1] / "scripts" / "research" / "lineage_curve.py"
)
lineage_curve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lineage_curve)


def test_parse_point_keeps_equals_signs_in_the_source_and_names_bad_counts():
    assert lineage_curve.parse_point("9700=19400=git:0828561") == ("9700", 19400, "git:0828561")
    assert lineage_curve.parse_point("a=5=runs/x=y") == ("a", 5, "runs/x=y")
    with pytest.raises(ValueError, match="'lots'"):
        lineage_curve.parse_point("a=lots=git:abc")
    with pytest.raises(ValueError, match="LABEL=CONVERSATIONS=SOURCE"):
        lineage_curve.parse_point("git:abc")
    with pytest.raises(ValueError, match="at least 1"):
        lineage_curve.parse_point("a=0=git:abc")


def test_fit_recovers_a_log_linear_curve_and_where_it_reaches_a_target():
    # accuracy = 0.1 + 0.05 * log2(n): 0.05 per doubling; 0.60 at log2(n) = 10, n = 1024.
    points = [(n, 0.1 + 0.05 * math.log2(n)) for n in (16, 64, 100, 500)]
    slope, intercept = lineage_curve.fit_per_doubling(points)
    assert slope == pytest.approx(0.05)
    assert intercept == pytest.approx(0.1)
    assert lineage_curve.conversations_for(0.60, slope, intercept) == pytest.approx(1024)
    assert lineage_curve.conversations_for(0.60, -0.01, 0.5) is None
    with pytest.raises(ValueError, match="two distinct"):
        lineage_curve.fit_per_doubling([(10, 0.3), (10, 0.4)])


def test_checkout_draft_writes_the_folder_as_it_was_at_a_commit(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "drafts" / "d").mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    monkeypatch.chdir(repo)
    (repo / "drafts" / "d" / "config.json").write_text('{"v": 1}')
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "one"], check=True)
    first = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (repo / "drafts" / "d" / "config.json").write_text('{"v": 2}')
    subprocess.run(git + ["commit", "-q", "-am", "two"], check=True)

    out = lineage_curve.checkout_draft(first, "drafts/d", str(tmp_path / "out"))
    assert (pathlib.Path(out) / "config.json").read_text() == '{"v": 1}'
    with pytest.raises(ValueError, match="no folder 'drafts/missing'"):
        lineage_curve.checkout_draft(first, "drafts/missing", str(tmp_path / "out2"))
