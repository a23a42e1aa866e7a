"""eval.video_every: a video of one evaluation episode every N evaluations into <run dir>/videos/iter_<I>/, the
evaluation's own numbers unchanged by it, and one clear line (before the run starts) for what is missing: eval.every,
moviepy, pygame (classic control renders with it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spmd_rl.config import load_config
from spmd_rl.config.loading import evaluation_env
from spmd_rl.run.evaluation import check_video
from spmd_rl.runtime.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "ci_tiny.yaml"


def test_video_every_without_eval_every_is_one_line():
    with pytest.raises(UserError, match=r"eval.video_every .* eval.every=0 never evaluates; set eval.every"):
        load_config(TINY, ["eval.video_every=2"])


def test_the_default_config_yaml_holds_no_video_key():
    assert "video_every" not in load_config(TINY).to_yaml()  # the digest, and so the run directory, as before


def test_check_video_renders_a_frame_and_names_what_is_missing(monkeypatch):
    pytest.importorskip("moviepy")
    pytest.importorskip("pygame")
    env = evaluation_env(load_config(TINY, ["eval.every=2", "eval.video_every=2"]))
    check_video(env)  # CartPole renders with pygame
    monkeypatch.setitem(sys.modules, "moviepy", None)  # as when not installed
    with pytest.raises(UserError, match=r'needs moviepy: pip install -e "\.\[video\]"'):
        check_video(env)
    monkeypatch.delitem(sys.modules, "moviepy")
    monkeypatch.setitem(sys.modules, "pygame", None)
    with pytest.raises(UserError, match=r"eval.video_every: env 'CartPole-v1' cannot render a frame: .*pygame"):
        check_video(env)


@pytest.mark.slow
def test_a_run_records_every_second_evaluation_and_its_numbers_stay(tmp_path):
    pytest.importorskip("moviepy")
    pytest.importorskip("pygame")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("DISPLAY", None)
    runs = {}
    for name, extra in (("plain", []), ("video", ["eval.video_every=2"])):
        command = [sys.executable, "-m", "spmd_rl.main", "--config", str(TINY), f"run.dir={tmp_path / name}"]
        command += ["eval.every=2", "eval.episodes=2", *extra]
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert "error" not in done.stderr  # nothing from SDL or ffmpeg
        runs[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    # 8 iterations, evaluations after iterations 1, 3, 5, 7: the 2nd and the 4th are recorded
    videos = sorted(p.relative_to(tmp_path / "video") for p in (tmp_path / "video").rglob("*.mp4"))
    assert [str(p) for p in videos] == [
        "videos/iter_000000003/eval-episode-0.mp4",
        "videos/iter_000000007/eval-episode-0.mp4",
    ]
    assert all((tmp_path / "video" / p).stat().st_size > 1000 for p in videos)
    assert not (tmp_path / "plain" / "videos").exists()
    for key in ("eval_return_mean", "episode_return_mean", "policy_loss"):  # the video episode changes nothing
        assert [r.get(key) for r in runs["plain"]] == [r.get(key) for r in runs["video"]], key
