"""`paratron schedule` end to end, called in-process: it starts no workers, and spawning an
interpreter per case would cost more than the command itself."""

from __future__ import annotations

import re

import pytest

from paratron.cli import main
from paratron.parallel.pipeline.schedules import build_schedule, simulate, theoretical_bubble


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["schedule", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_draws_and_reports_the_bubble(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "--pp", "4", "--microbatches", "8", "--schedule", "zb-h1", "--output", "tmp/x.png")
    assert code == 0, err
    png = tmp_path / "tmp" / "x.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary, where = out.strip().splitlines()
    expected = simulate(build_schedule("zb-h1", 4, 8)).bubble_fraction()
    shown = re.search(r"bubble (\d+\.\d)% of the step \(theory \(p-1\)/\(3m\+p-1\) = (\d+\.\d)%\)", summary)
    assert shown, summary
    assert shown.group(1) == f"{100 * expected:.1f}" == "11.1"
    assert shown.group(2) == f"{100 * theoretical_bubble('zb-h1', 4, 8):.1f}"
    assert summary.startswith("zb-h1: pp 4, 8 micro-batches: ")
    assert summary.endswith("peak live micro-batch activations per rank: 4 3 2 1")
    assert where == "timeline: tmp/x.png"


def test_default_output_goes_into_the_run_folder_and_print(tmp_path, monkeypatch, capsys):
    """Without --output the PNG goes into the run folder (train's default, runs/latest), never
    straight into the current folder; --run-dir moves it."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run(
        capsys, "--pp", "2", "--microbatches", "4", "--schedule", "interleaved", "--vpp", "2", "--print"
    )
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith("rank 0: F0 ") and lines[1].startswith("rank 1: F0 ")
    assert "theory ((p-1)/v)/(m+(p-1)/v) = 11.1%" in lines[2]
    assert lines[3] == "timeline: runs/latest/schedule-interleaved-pp2-m4-v2.png"
    assert (tmp_path / "runs" / "latest" / "schedule-interleaved-pp2-m4-v2.png").stat().st_size > 0
    code, out, err = run(capsys, "--pp", "2", "--microbatches", "2", "--run-dir", str(tmp_path / "mine"))
    assert code == 0, err
    assert out.strip().splitlines()[-1] == f"timeline: {tmp_path / 'mine' / 'schedule-1f1b-pp2-m2.png'}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "runs"]  # nothing else in the current folder


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--schedule", "interleaved", "--pp", "4", "--microbatches", "6", "--vpp", "2"],
            "divisible by the pipeline size (4)",
        ),
        (["--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--vpp", "2"], "virtual stages need 'interleaved'"),
        (["--pp", "0", "--microbatches", "8"], "--pp 0: must be at least 1"),
        (["--pp", "2"], "the following arguments are required: --microbatches"),
        (["--pp", "2", "--microbatches", "4", "--schedule", "pipedream"], "invalid choice: 'pipedream'"),
    ],
)
def test_mistakes_exit_2_with_one_line(tmp_path, monkeypatch, capsys, args, expected):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err
    assert out == "" and list(tmp_path.iterdir()) == []
