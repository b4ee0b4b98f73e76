"""`make vlm-demo` (scripts/vlm_demo.py) still works: its pictures and files are what paratron reads as LLaVA's
form, and its --smoke run (a few pictures, a few steps per stage) goes through every stage, trains in each
only the parts it names, and reports accuracies, its batched answers agreeing with the library's generation."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from paratron.data.vision.llava import read_vision_records

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import vlm_demo  # noqa: E402  (the script, by name)


def test_pictures_show_their_captions(tmp_path: Path) -> None:
    heldout = vlm_demo.write_data(tmp_path, 12, 3)
    for stage, per_picture in (("words", 4), ("captions", 1), ("questions", 3), ("heldout", 3)):
        records = list(read_vision_records(tmp_path / f"{stage}.json"))
        assert len(records) == per_picture * (3 if stage == "heldout" else 12), stage
        assert all(len(r.images) == (stage != "words") for r in records), stage
    name, scene = heldout[0]
    picture = Image.open(tmp_path / name)
    x, y = (c + s for c, s in zip(vlm_demo.PLACES[scene.place], scene.shift, strict=True))
    assert picture.size == (vlm_demo.SIZE, vlm_demo.SIZE)
    assert picture.getpixel((x, y)) == vlm_demo.COLOURS[scene.colour]  # the shape's centre
    assert picture.getpixel((31 - x // 16 * 31, 31 - y // 16 * 31)) == vlm_demo.BACKGROUND  # the far corner
    asked = [r.messages for r in read_vision_records(tmp_path / "heldout.json")][:3]
    assert [m[1]["content"] for m in asked] == [scene.colour, scene.shape, scene.place]


@pytest.mark.spawns
def test_smoke_run(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts/vlm_demo.py"), "--smoke", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    reports = re.findall(
        r"held-out accuracy (before stage 0|after stage \d).*?: answers (\d+)% \(colour \d+%, shape \d+%, "
        r"place \d+%\), captions (\d+)%",
        run.stdout,
    )
    assert [when for when, _, _ in reports] == ["before stage 0", "after stage 0", "after stage 1", "after stage 2"]
    assert all(0 <= int(answers) <= 100 and 0 <= int(captions) <= 100 for _, answers, captions in reports)
    changed = re.findall(r"weights (stage \d) changed: (.*)", run.stdout)  # each stage trains its parts alone
    trained = ["language model", "projector", "projector, language model"]
    assert changed == [(f"stage {n}", parts) for n, parts in enumerate(trained)]
    assert re.search(r"time per stage: stage 0 \d+s, stage 1 \d+s, stage 2 \d+s", run.stdout)
