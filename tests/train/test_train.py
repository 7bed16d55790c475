import dataclasses
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import minifloat
from minifloat import checkpoint
from minifloat.data.corpus import get_batch, load_corpus, stdlib_corpus
from minifloat.gemm import support
from minifloat.models.gpt import GPT, GPT_SIZES
from minifloat.nn.rounded import RoundedLinear
from minifloat.train.config import TrainConfig, lr_at
from minifloat.train.loop import build_model, evaluate, load_data, train
from minifloat.train.runlog import read_log

ROOT = Path(__file__).resolve().parents[2]


def _cfg(**kw):
    base = dict(model="tiny", steps=6, batch_size=4, seq_len=32, eval_every=3, eval_batches=2,
                checkpoint_every=3, max_bytes=200_000, warmup=2)  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def _losses(out):
    return [json.loads(line)["loss"] for line in (Path(out) / "log.jsonl").read_text().splitlines()]


def test_stdlib_corpus_is_deterministic_and_split():
    a, b = stdlib_corpus(max_bytes=50_000), stdlib_corpus(max_bytes=50_000)
    assert a.sha256 == b.sha256 and len(a.val) == 5_000 and len(a.train) == 45_000
    assert b"def " in bytes(a.train.tolist())
    x, y = get_batch(a.train, 3, 16, torch.Generator().manual_seed(0))
    assert x.shape == (3, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_data_errors_name_the_path(tmp_path):
    with pytest.raises(minifloat.MinifloatError, match="no such file"):
        load_corpus(tmp_path / "nope.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(minifloat.MinifloatError, match="no text files"):
        load_corpus(tmp_path / "empty")
    (tmp_path / "bin.txt").write_bytes(b"abc\x00def" * 1000)
    with pytest.raises(minifloat.MinifloatError, match="binary file"):
        load_corpus(tmp_path / "bin.txt")
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9 " * 1000)
    with pytest.raises(minifloat.MinifloatError, match="not UTF-8"):
        load_corpus(tmp_path / "latin.txt")
    (tmp_path / "short.txt").write_text("hello")
    with pytest.raises(minifloat.MinifloatError, match="only 5 bytes"):
        load_corpus(tmp_path / "short.txt")
    (tmp_path / "ok.txt").write_text("the quick brown fox. " * 500)
    assert len(load_corpus(tmp_path / "ok.txt").train) > 0


def test_config_file_round_trips_and_bad_ones_are_named(tmp_path):
    c = _cfg(precision="mxfp8", lr=3e-4)
    (tmp_path / "c.json").write_text(json.dumps(c.to_dict()))
    assert TrainConfig.from_json(tmp_path / "c.json") == c
    for text, match in [
        ('{"steps": 10, "stepz": 3}', r"not a train config \(unknown fields \['stepz'\]\)"),
        ('{"steps": "10"}', "a field has the wrong type"),
        ("[1, 2]", r"not a train config \(unknown fields list\)"),
        ("{", "cannot read the train config"),
    ]:
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(minifloat.MinifloatError, match=match):
            TrainConfig.from_json(tmp_path / "bad.json")


def test_a_folder_is_read_only_up_to_max_bytes(tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"{i}.txt").write_text(f"file {i} " * 1000)
    (texts / "3.txt").write_bytes(b"\x00")  # past max_bytes: never opened, so never refused
    data = load_corpus(texts, max_bytes=10_000)
    whole = bytes(torch.cat([data.train, data.val]).tolist())
    assert whole == ((texts / "0.txt").read_bytes() + (texts / "1.txt").read_bytes())[:10_000]
    (tmp_path / "euro.txt").write_text("€" * 5000)  # 3 bytes each: 10_000 cuts one in two
    assert len(load_corpus(tmp_path / "euro.txt", max_bytes=10_000).train) == 9_000
    (tmp_path / "cut.txt").write_bytes(b"x" * 3000 + "€".encode()[:2])  # cut by the file's own end
    with pytest.raises(minifloat.MinifloatError, match="not UTF-8"):
        load_corpus(tmp_path / "cut.txt", max_bytes=10_000)


def test_stdlib_corpus_reads_sorted_sources_without_tests_or_site_packages(tmp_path, monkeypatch):
    import sysconfig

    lib = tmp_path / "lib"
    for rel, text in [("b.py", "b" * 6000), ("a.py", "a" * 6000), ("pkg/c.py", "c" * 6000),
                      ("test/t.py", "T"), ("pkg/tests/t.py", "T"), ("site-packages/s.py", "S"),
                      ("idlelib/i.py", "I"), ("notes.txt", "N"), ("dir.py/x.txt", "X")]:  # fmt: skip
        (lib / rel).parent.mkdir(parents=True, exist_ok=True)
        (lib / rel).write_text(text)
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(lib)})
    data = stdlib_corpus(max_bytes=15_000)  # stops reading at the third file
    assert bytes(torch.cat([data.train, data.val]).tolist()) == b"a" * 6000 + b"b" * 6000 + b"c" * 3000
    assert (len(data.train), len(data.val)) == (13_500, 1_500)  # the last 10 % is validation
    (lib / "pkg" / "c.py").write_text("c" * 100)
    assert len(stdlib_corpus(max_bytes=15_000).train) == 10_890  # all 12,100 bytes there are
    (lib / "b.py").unlink()  # 6,100 bytes: under the 10,000 a corpus needs
    with pytest.raises(minifloat.MinifloatError, match="too little source for a corpus; use --data PATH"):
        stdlib_corpus()


def test_a_folder_corpus_reads_text_files_only(tmp_path):
    (tmp_path / "a.png").write_bytes(b"\x89PNG\x00" * 100)  # sorted first, skipped by its suffix
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.MD").write_text("# b\n" * 1000)
    (tmp_path / "c.py").write_text("c = 1\n" * 500)
    data = load_corpus(tmp_path)
    assert bytes(torch.cat([data.train, data.val]).tolist()) == b"c = 1\n" * 500 + b"# b\n" * 1000
    assert len(data.val) == (3000 + 4000) // 10


def test_batches_are_windows_of_the_data_and_their_next_bytes(tmp_path):
    data = torch.arange(40, dtype=torch.uint8)
    x, y = get_batch(data, 2000, 8, torch.Generator().manual_seed(1))
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (2000, 8)
    starts = x[:, 0]
    assert torch.equal(x, starts[:, None] + torch.arange(8)) and torch.equal(y, x + 1)
    # Every window of 9 bytes is drawn, the last one ending on the last byte (a target too).
    assert sorted(set(starts.tolist())) == list(range(40 - 8))
    only = get_batch(data[:9], 4, 8, torch.Generator())  # 9 bytes: one window
    assert torch.equal(only[0], torch.arange(8).expand(4, 8)) and torch.equal(only[1], only[0] + 1)
    with pytest.raises(minifloat.MinifloatError, match="has 8 bytes; --seq-len 8 needs at least 9: give more"):
        get_batch(data[:8], 4, 8, torch.Generator())
    (tmp_path / "2k.txt").write_text("x" * 2048)  # the smallest corpus file accepted
    assert len(load_corpus(tmp_path / "2k.txt").val) == 204
    (tmp_path / "2k.txt").write_text("x" * 2047)
    with pytest.raises(minifloat.MinifloatError, match="only 2047 bytes of text; give at least 2 KiB"):
        load_corpus(tmp_path / "2k.txt")


def test_gpt_sizes_and_tied_embeddings():
    assert 2.5e6 < GPT(GPT_SIZES["small"]).num_params() < 3.5e6
    model = build_model(_cfg(precision="mxfp8"))
    assert model.lm_head.weight is model.wte.weight and type(model.lm_head) is torch.nn.Linear
    assert isinstance(model.blocks[0].mlp.fc, minifloat.nn.Linear)
    c = _cfg(lr=1.0)  # warmup 2, then cosine over 4 steps down to 0.1
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p / 4)) for p in range(5)]
    assert [lr_at(s, c) for s in range(7)] == pytest.approx([0.5, 1.0, *cosine], rel=1e-12)


@pytest.mark.parametrize("precision,states,master", [("fp8", "fp32", "fp32"), ("nvfp4", "fp32", "fp32"), ("bf16", "fp32", "fp32"),
                                                     ("fp8", "fp8-dre", "bf16-sr"), ("fp8", "fp8", "bf16+remainder"),
                                                     ("bf16", "bf16", "bf16-sr")])  # fmt: skip
def test_resume_is_bit_identical(tmp_path, precision, states, master):
    full, part = tmp_path / "full", tmp_path / "part"
    kw = dict(precision=precision, optimizer_states=states, master=master)
    train(_cfg(**kw), full, progress=False)
    train(_cfg(**kw, steps=3), part, progress=False)
    train(_cfg(**kw), part, resume=True, progress=False)
    assert _losses(part) == _losses(full)
    last_full = json.loads((full / "log.jsonl").read_text().splitlines()[-1])
    last_part = json.loads((part / "log.jsonl").read_text().splitlines()[-1])
    assert last_full["val_loss"] == last_part["val_loss"]


def test_resume_rewinds_the_log_to_the_checkpoint(tmp_path):
    # A run killed after logging steps past its last checkpoint, the last line torn mid-write:
    # the resumed run logs those steps once, from the checkpoint, as an uninterrupted run does.
    full, part = tmp_path / "full", tmp_path / "part"
    train(_cfg(steps=4, checkpoint_every=0), full, progress=False)
    train(_cfg(steps=2, checkpoint_every=0), part, progress=False)
    with open(part / "log.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 99.0}\n{"step": 4, "lo')
    c = _cfg(steps=4, checkpoint_every=0)
    result = train(c, part, resume=True, progress=False)
    assert [r["step"] for r in read_log(part / "log.jsonl")] == [1, 2, 3, 4]
    assert _losses(part) == _losses(full) and result["final"]["step"] == 4
    # Resuming a finished run trains nothing and reports its last step; fewer steps is an error.
    assert train(c, part, resume=True, progress=False)["final"] == json.loads(
        (part / "log.jsonl").read_text().splitlines()[-1])
    assert _losses(part) == _losses(full)
    with pytest.raises(minifloat.MinifloatError, match=r"ckpt-00000004 is at step 4, past --steps 3; pass --steps 4 or more"):
        train(_cfg(steps=3), part, resume=True, progress=False)
    # A run whose log was deleted resumes too: the new log starts after the checkpoint.
    (part / "log.jsonl").unlink()
    train(_cfg(steps=5, checkpoint_every=0), part, resume=True, progress=False)
    assert [r["step"] for r in read_log(part / "log.jsonl")] == [5]


def test_telemetry_samples_the_trainers_steps_when_a_step_is_skipped(tmp_path, monkeypatch):
    real_loss, calls = torch.nn.functional.cross_entropy, []

    def inf_first(*args, **kwargs):  # an actual inf loss in step 0: its gradients are not finite
        calls.append(None)
        loss = real_loss(*args, **kwargs)
        return loss * float("inf") if len(calls) == 1 else loss

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", inf_first)
    train(_cfg(precision="fp8-current", telemetry_every=2, steps=5, checkpoint_every=0), tmp_path, progress=False)
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in log] == [True, False, False, False, False]
    assert ["max_saturated" in r["telemetry"] for r in log] == [True, False, True, False, True]  # steps 0, 2, 4
    assert log[0]["telemetry"]["first_nonfinite"]["step"] == 0  # the inf loss's gradients, seen


def test_resume_in_another_precision_and_mismatch_errors(tmp_path):
    train(_cfg(precision="fp8", steps=3), tmp_path, progress=False)
    result = train(_cfg(precision="nvfp4"), tmp_path, resume=True, progress=False)
    assert result["final"]["step"] == 6
    with pytest.raises(minifloat.MinifloatError, match="checkpoint has batch_size=4, this run batch_size=8"):
        train(_cfg(precision="fp8", batch_size=8), tmp_path, resume=True, progress=False)
    with pytest.raises(minifloat.MinifloatError, match="no checkpoint under"):
        train(_cfg(), tmp_path / "empty", resume=True, progress=False)
    # Into delayed scaling from a precision without its amax histories: they start empty.
    train(_cfg(precision="fp32", steps=3), tmp_path / "fp32", progress=False)
    assert train(_cfg(precision="fp8"), tmp_path / "fp32", resume=True, progress=False)["final"]["step"] == 6


@pytest.mark.parametrize("edit", ["extra", "missing"])
def test_resume_refuses_weights_of_another_model(tmp_path, edit):
    train(_cfg(steps=3), tmp_path / "run", progress=False)
    manifest, weights, state = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(tmp_path / "run" / "checkpoints"))
    if edit == "extra":
        weights["blocks.2.mlp.fc.weight"] = torch.zeros(256, 64)
        message = r"missing \[\], unexpected \['blocks.2.mlp.fc.weight'\]"
    else:
        del weights["blocks.1.mlp.fc.bias"]
        message = r"missing \['blocks.1.mlp.fc.bias'\], unexpected \[\]"
    checkpoint.save_checkpoint(tmp_path / "run" / "checkpoints", 4, weights, state, manifest["config"])
    with pytest.raises(minifloat.MinifloatError, match="ckpt-00000004: weights do not fit the tiny model \\(" + message):
        train(_cfg(), tmp_path / "run", resume=True, progress=False)


def test_a_fresh_run_refuses_an_earlier_one_unless_told_to_overwrite_it(tmp_path):
    train(_cfg(steps=3), tmp_path, progress=False)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(minifloat.MinifloatError, match=r"already holds a run \(a checkpoint \(ckpt-00000003\)\); pass --resume"):
        train(_cfg(), tmp_path, progress=False)
    with pytest.raises(minifloat.MinifloatError, match="pass one of them"):
        train(_cfg(), tmp_path, resume=True, overwrite=True, progress=False)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing lost
    (tmp_path / "checkpoints" / "latest").unlink()  # the folder still names the checkpoint
    with pytest.raises(minifloat.MinifloatError, match=r"already holds a run \(a checkpoint \(ckpt-00000003\)\)"):
        train(_cfg(), tmp_path, progress=False)
    (tmp_path / "checkpoints" / "ckpt-00000003" / "manifest.json").unlink()
    with pytest.raises(minifloat.MinifloatError, match=r"already holds a run \(log.jsonl and checkpoints\)"):
        train(_cfg(), tmp_path, progress=False)
    result = train(_cfg(steps=2, checkpoint_every=0), tmp_path, overwrite=True, progress=False)
    assert result["final"]["step"] == 2 and len(_losses(tmp_path)) == 2
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()] == ["ckpt-00000002"]


def test_default_sequence_length_fits_every_model_and_out_must_be_a_folder(tmp_path):
    assert [TrainConfig(model=m).seq_len for m in ("tiny", "small", "base")] == [64, 128, 128]
    (tmp_path / "f").write_text("mine")
    with pytest.raises(minifloat.MinifloatError, match="is a file; give a folder"):
        train(_cfg(), tmp_path / "f", progress=False)
    assert (tmp_path / "f").read_text() == "mine"


def test_without_the_latest_pointer_the_newest_checkpoint_is_used(tmp_path):
    # e.g. checkpoint folders copied without `latest`: resume from the newest, and say so
    root = tmp_path / "ckpts"
    assert checkpoint.latest_checkpoint(root) is None
    checkpoint.save_checkpoint(root, 2, {"w": torch.ones(2)}, {"step": 2}, {})
    (root / "latest").unlink()
    (root / "ckpt-00000009").mkdir()  # no manifest: not a checkpoint
    with pytest.warns(UserWarning, match="has no 'latest' pointer; using the newest checkpoint, ckpt-00000002"):
        assert checkpoint.latest_checkpoint(root).name == "ckpt-00000002"
    new = checkpoint.save_checkpoint(root, 4, {"w": torch.zeros(2)}, {"step": 4}, {})
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-00000004", "ckpt-00000009", "latest"]
    assert checkpoint.latest_checkpoint(root) == new


def test_saving_a_step_again_keeps_the_old_folder_until_latest_moves(tmp_path, monkeypatch):
    root = tmp_path / "ckpts"
    first = checkpoint.save_checkpoint(root, 3, {"w": torch.ones(2)}, {"step": 3}, {})
    second = checkpoint.save_checkpoint(root, 3, {"w": torch.zeros(2)}, {"step": 3}, {})
    assert second.name == "ckpt-00000003.1" and not first.exists()
    assert checkpoint.latest_checkpoint(root) == second
    assert torch.equal(checkpoint.load_checkpoint(second)[1]["w"], torch.zeros(2))

    def crash(path):  # killed after the new folder is in place, before `latest` moves
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "atomic_path", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(root, 3, {"w": torch.full((2,), 7.0)}, {"step": 3}, {})
    assert checkpoint.latest_checkpoint(root) == second  # still there, still complete
    assert torch.equal(checkpoint.load_checkpoint(second)[1]["w"], torch.zeros(2))


def test_checkpoints_are_readable_by_the_group_as_the_umask_says(tmp_path):
    old = os.umask(0o022)
    try:
        train(_cfg(steps=3), tmp_path, progress=False)
    finally:
        os.umask(old)
    ckpt = checkpoint.latest_checkpoint(tmp_path / "checkpoints")
    assert ckpt.stat().st_mode & 0o777 == 0o755  # not tempfile.mkdtemp's 0700
    for f in ckpt.iterdir():
        assert f.stat().st_mode & 0o777 == 0o644, f.name  # model.safetensors: not safetensors' 0600


def test_corrupted_checkpoint_is_rejected_with_the_file_named(tmp_path):
    train(_cfg(steps=3), tmp_path, progress=False)
    ckpt = checkpoint.latest_checkpoint(tmp_path / "checkpoints")
    state = ckpt / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    with pytest.raises(minifloat.MinifloatError, match="state.pt: checksum mismatch"):
        train(_cfg(), tmp_path, resume=True, progress=False)


@pytest.mark.parametrize(
    "edit",
    [lambda m: {**m, "sha256": {}}, lambda m: {**m, "sha256": {"model.safetensors": m["sha256"]["model.safetensors"]}},
     lambda m: [m], lambda m: {**m, "sha256": "x"}, lambda m: {**m, "format": "other"}],
)  # fmt: skip
def test_an_altered_manifest_is_rejected_not_trusted(tmp_path, edit):
    # a manifest that drops a checksum would let an unverified state.pt through
    ckpt = checkpoint.save_checkpoint(tmp_path, 1, {"w": torch.ones(2)}, {"step": 1}, {})
    manifest = ckpt / "manifest.json"
    manifest.write_text(json.dumps(edit(json.loads(manifest.read_text()))))
    with pytest.raises(minifloat.CorruptFileError, match="manifest.json: (not a minifloat checkpoint manifest|the checksums "
                       "of model.safetensors, state.pt are missing; the manifest was altered)"):  # fmt: skip
        checkpoint.load_checkpoint(ckpt)


class _NotWeights:  # torch.load(weights_only=True) must refuse to build it
    pass


def test_a_state_pt_that_needs_full_unpickling_is_refused_even_with_valid_checksums(tmp_path):
    # The manifest's checksums catch damage, not a forger who rewrites them: state.pt is read
    # with weights_only=True, so arbitrary pickled objects (code) are refused all the same.
    ckpt = checkpoint.save_checkpoint(tmp_path, 1, {"w": torch.ones(2)}, {"step": 1}, {})
    torch.save({"step": 1, "payload": _NotWeights()}, ckpt / "state.pt")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["sha256"]["state.pt"] = hashlib.sha256((ckpt / "state.pt").read_bytes()).hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(minifloat.CorruptFileError, match=r"state.pt: cannot be read safely"):
        checkpoint.load_checkpoint(ckpt)


_KILL_SCRIPT = """
import os, signal, sys
import torch
from minifloat import checkpoint
from minifloat.train import TrainConfig, train
real = torch.save
def save_then_die(obj, path, *a, **k):
    real(obj, path, *a, **k)
    if int(obj["step"]) == 6:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-write: state.pt done, manifest not yet
torch.save = save_then_die
cfg = TrainConfig(model="tiny", steps=6, batch_size=4, seq_len=32, eval_every=3, eval_batches=2,
                  checkpoint_every=3, max_bytes=200_000, warmup=2)
train(cfg, sys.argv[1], progress=False)
"""


def test_sigkill_during_checkpoint_write_resumes_from_the_last_complete_one(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, str(out)], env=env, capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert checkpoint.latest_checkpoint(out / "checkpoints").name == "ckpt-00000003"
    assert list((out / "checkpoints").glob(".ckpt-tmp-*"))  # the half-written one
    result = train(_cfg(), out, resume=True, progress=False)
    assert result["final"]["step"] == 6
    assert not list((out / "checkpoints").glob(".ckpt-tmp-*"))  # cleared by the next save
    full = train(_cfg(), tmp_path / "full", progress=False)
    assert result["final"]["loss"] == full["final"]["loss"]


_TIMED_KILL_SCRIPT = """
import os, signal, sys
import torch
from minifloat.train import TrainConfig, train
real = torch.save
def die_on_the_sixth(obj, path, *a, **k):
    if int(obj["step"]) == 6:
        os.kill(os.getpid(), signal.SIGKILL)  # killed as the sixth timed checkpoint starts
    real(obj, path, *a, **k)
torch.save = die_on_the_sixth
cfg = TrainConfig(model="tiny", steps=8, batch_size=4, seq_len=32, eval_every=0, eval_batches=2, checkpoint_every=0,
                  checkpoint_minutes=1e-9, keep_checkpoints=2, max_bytes=200_000, warmup=2)
train(cfg, sys.argv[1], progress=False)
"""


def test_a_run_killed_without_step_checkpoints_resumes_from_its_last_timed_one(tmp_path):
    """No --checkpoint-every: checkpoints come by time (here every step: a 1e-9-minute interval),
    the newest `keep_checkpoints` kept; SIGKILL mid-run loses only the steps since the last."""
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-c", _TIMED_KILL_SCRIPT, str(out)], env=env, capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert [p.name for p in checkpoint.checkpoints(out / "checkpoints")] == ["ckpt-00000004", "ckpt-00000005"]
    assert checkpoint.latest_checkpoint(out / "checkpoints").name == "ckpt-00000005"
    cfg = _cfg(steps=8, eval_every=0, checkpoint_every=0, checkpoint_minutes=1e-9, keep_checkpoints=2)
    result = train(cfg, out, resume=True, progress=False)
    assert result["final"]["step"] == 8 and len(_losses(out)) == 8
    assert [p.name for p in checkpoint.checkpoints(out / "checkpoints")] == ["ckpt-00000007", "ckpt-00000008"]
    full = train(cfg, tmp_path / "full", progress=False)
    assert result["final"]["loss"] == full["final"]["loss"]  # resumed bit for bit
    quiet = train(_cfg(steps=3, checkpoint_every=0), tmp_path / "quiet", progress=False)  # 5 minutes: none till the end
    assert quiet["final"]["step"] == 3 and [p.name for p in checkpoint.checkpoints(tmp_path / "quiet" / "checkpoints")] == ["ckpt-00000003"]
    for bad, match in (({"checkpoint_minutes": -1.0}, "--checkpoint-minutes must be"), ({"keep_checkpoints": 0}, "--keep-checkpoints must be")):
        with pytest.raises(minifloat.MinifloatError, match=match):
            _cfg(**bad)


def test_high_precision_last_blocks_and_head_stay_unquantized():
    model = build_model(_cfg(precision="nvfp4", high_precision_last=1))
    kinds = {fqn: type(m).__name__ for fqn, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds["blocks.0.mlp.fc"] == "Linear" and isinstance(model.blocks[0].mlp.fc, minifloat.nn.Linear)
    assert not isinstance(model.blocks[1].mlp.fc, minifloat.nn.Linear)
    assert not isinstance(model.lm_head, minifloat.nn.Linear)
    assert isinstance(build_model(_cfg(precision="nvfp4", quantize_head=True)).lm_head, minifloat.nn.Linear)
    with pytest.raises(minifloat.MinifloatError, match="has 2 blocks"):
        _cfg(high_precision_last=3)
    first = build_model(_cfg(precision="nvfp4", high_precision_first=1))
    assert not isinstance(first.blocks[0].attn.qkv, minifloat.nn.Linear)
    assert isinstance(first.blocks[1].mlp.fc, minifloat.nn.Linear) and not isinstance(first.blocks[0].mlp.fc, minifloat.nn.Linear)
    with pytest.raises(minifloat.MinifloatError, match="--high-precision-first 3: the tiny model has 2 blocks"):
        _cfg(high_precision_first=3)
    # mxfp4 keeps its first block by its recipe, as --high-precision-first 1 does for mxfp4-tseng: the same model
    by_recipe, by_flag = build_model(_cfg(precision="mxfp4")), build_model(_cfg(precision="mxfp4-tseng", high_precision_first=1))
    kinds = [{f: type(m) for f, m in model.named_modules() if isinstance(m, torch.nn.Linear)} for model in (by_recipe, by_flag)]
    assert kinds[0] == kinds[1] and kinds[0]["blocks.0.attn.qkv"] is torch.nn.Linear and kinds[0]["blocks.1.attn.qkv"] is minifloat.nn.Linear


def test_a_precision_switch_trains_and_validates_its_last_steps_in_bf16(tmp_path, monkeypatch):
    import minifloat.nn.linear as linear_module
    from minifloat.models.gpt import get_config
    from minifloat.train.task import GPTTask

    calls = []
    real = linear_module.quantize
    monkeypatch.setattr(linear_module, "quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    switched, plain = tmp_path / "switched", tmp_path / "plain"
    c = _cfg(precision="nvfp4", precision_switch=0.5, checkpoint_every=0)
    assert c.switch_step() == 3
    train(c, switched, progress=False)
    in_switched = len(calls)
    train(_cfg(precision="nvfp4", checkpoint_every=0), plain, progress=False)
    log, plain_log = read_log(switched / "log.jsonl"), read_log(plain / "log.jsonl")
    # the same run up to the switch; then BF16 steps, said in the log, that quantize nothing
    assert [r["loss"] for r in log[:3]] == [r["loss"] for r in plain_log[:3]] and log[3]["loss"] != plain_log[3]["loss"]
    assert [r.get("computed_in") for r in log] == [None] * 3 + ["bf16"] * 3
    assert log[2]["val_loss"] == plain_log[2]["val_loss"]  # validation before the switch: in NVFP4, as the plain run's
    # as much quantized as 3 NVFP4 steps and their evaluations before the first step and after the third
    calls.clear()
    train(_cfg(precision="nvfp4", checkpoint_every=0, steps=3), tmp_path / "three", progress=False)
    assert in_switched == len(calls) > 0
    # the final validation is the trained weights' BF16 loss, computed here without minifloat's layers
    _, weights, _ = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(switched / "checkpoints"))
    model = GPT(get_config("tiny"))
    model.load_state_dict(weights, strict=False)
    task = GPTTask()
    task.prepare(c)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = sum(task.loss(model.eval(), b).item() for b in task.val_batches(c)) / c.eval_batches
    assert log[-1]["val_loss"] == pytest.approx(bf16, rel=1e-6)
    for value in (1.0, -0.1, float("nan")):
        with pytest.raises(minifloat.MinifloatError, match=r"--precision-switch is the fraction of the steps trained in BF16"):
            _cfg(precision="nvfp4", precision_switch=value)
    with pytest.raises(minifloat.MinifloatError, match="--precision bf16 trains no recipe's GEMMs"):
        _cfg(precision="bf16", precision_switch=0.1)
    with pytest.raises(minifloat.MinifloatError, match="--precision-switch trains its last steps on the BF16 weights"):
        _cfg(precision="fp8-current", precision_switch=0.1, fsdp=True, fp8_all_gather=True)
    for steps, value in ((6, 0.05), (2, 0.9)):  # no step switched, or every one
        with pytest.raises(minifloat.MinifloatError, match=rf"--precision-switch {value} of --steps {steps} switches"):
            _cfg(precision="nvfp4", precision_switch=value, steps=steps)
    assert _cfg(precision="nvfp4", precision_switch=0.1, steps=6).switch_step() == 5  # round(0.6): one step
    with pytest.raises(minifloat.MinifloatError, match="--precision nvfp4 with --lora trains no recipe's GEMMs"):
        TrainConfig(pretrained="m", steps=1, lora_rank=4, precision="nvfp4", precision_switch=0.1)


def test_outlier_channels_reach_every_converted_layer_and_change_its_forward(tmp_path):
    from minifloat.train.task import build_gpt

    model = build_gpt(_cfg(precision="nvfp4", outlier_channels=4, high_precision_last=1))
    converted = {n: m.recipe for n, m in model.named_modules() if isinstance(m, minifloat.nn.Linear)}
    assert converted and all(n.startswith("blocks.0.") for n in converted)  # the kept block and the head stay plain
    assert {r.outlier_channels for r in converted.values()} == {4} and {r.kind for r in converted.values()} == {"nvfp4"}
    plain, split = tmp_path / "plain", tmp_path / "split"
    train(_cfg(precision="nvfp4", steps=2, checkpoint_every=0), plain, progress=False)
    train(_cfg(precision="nvfp4", steps=2, checkpoint_every=0, outlier_channels=4), split, progress=False)
    a, b = _losses(plain), _losses(split)
    assert all(math.isfinite(x) for x in b) and a[0] != b[0]  # the first forward already differs
    with pytest.raises(minifloat.MinifloatError, match="--precision bf16 trains no recipe's GEMMs"):
        _cfg(precision="bf16", outlier_channels=4)
    with pytest.raises(minifloat.MinifloatError, match="--outlier-channels is a whole number of input channels ≥ 0, got -1"):
        _cfg(precision="nvfp4", outlier_channels=-1)
    with pytest.raises(minifloat.MinifloatError, match="which --fp8-all-gather gathers as FP8 codes"):
        _cfg(precision="fp8-current", outlier_channels=4, fsdp=True, fp8_all_gather=True)
    with pytest.raises(minifloat.MinifloatError, match="--precision nvfp4 with --lora trains no recipe's GEMMs"):
        TrainConfig(pretrained="m", steps=1, lora_rank=4, precision="nvfp4", outlier_channels=4)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("lr", -1.0, "--lr must be a positive number, got -1.0"), ("lr", float("nan"), "--lr must be a positive number"),
     ("grad_clip", -1.0, "--grad-clip must be a number ≥ 0"), ("weight_decay", float("inf"), "--weight-decay must be"),
     ("min_lr_ratio", 1.5, "min_lr_ratio must be in"), ("min_lr_ratio", -0.1, "min_lr_ratio must be in"),
     ("warmup", -3, "--warmup must be ≥ 0"), ("lr", 0.0, "--lr must be a positive number, got 0.0"),
     ("high_precision_last", -1, "--high-precision-last -1: the tiny model has 2 blocks"),
     ("max_bytes", 0, "max_bytes ≥ 1, got 2 and 0"), ("telemetry_every", -1, "and --telemetry-every must be ≥ 0"),
     ("checkpoint_every", -1, "--checkpoint-every and"), ("eval_every", -1, "--eval-every, ")],
)
def test_config_rejects_bad_optimizer_settings(field, value, message):
    """Caught when the config is made, not as a torch.optim traceback in every run."""
    with pytest.raises(minifloat.MinifloatError, match=message):
        _cfg(**{field: value})


def test_config_accepts_the_ends_of_each_range():
    ends = dict(high_precision_last=2, min_lr_ratio=1.0, weight_decay=0.0, grad_clip=0.0, warmup=0, eval_every=0,
                checkpoint_every=0, telemetry_every=0, seq_len=64, max_bytes=1, steps=1, batch_size=1, grad_accum=1, eval_batches=1)  # fmt: skip
    for field, value in ends.items():
        assert getattr(_cfg(**{field: value}), field) == value
    assert _cfg(min_lr_ratio=0.0, high_precision_last=0).min_lr_ratio == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounded_linear_is_a_low_precision_gemm_with_fp32_accumulation(dtype):
    """bf16/fp16 emulation: operands rounded to `dtype`, products summed in FP32, the output
    (and the input's gradient) rounded to `dtype`; the weight's gradient stays FP32. Operands
    have 8 significant bits (exact in both dtypes) plus a quarter-ulp nudge that rounding must
    remove; their products and sums fit FP32 exactly, so a float64 GEMM of the rounded operands
    is an exact oracle."""
    gen = torch.Generator().manual_seed(0)

    def nudged(*shape):  # ±k/256, 128 ≤ k < 256, plus a quarter ulp (the ulp in [0.5, 1) is eps/2)
        k = torch.randint(128, 256, shape, generator=gen) * (torch.randint(0, 2, shape, generator=gen) * 2 - 1)
        return k / 256 + torch.finfo(dtype).eps / 8, (k / 256).double()

    x, x_r = nudged(2, 3, 16)
    w, w_r = nudged(8, 16)
    g, g_r = nudged(2, 3, 8)
    bias = torch.arange(8) / 64
    x.requires_grad_(True)
    lin = RoundedLinear(16, 8)
    lin.weight, lin.bias, lin.rounding_dtype = torch.nn.Parameter(w), torch.nn.Parameter(bias), dtype
    out = lin(x)
    out.backward(g)
    assert out.dtype == torch.float32
    assert torch.equal(out, (x_r @ w_r.T + bias.double()).to(dtype).float())
    assert torch.equal(x.grad, (g_r @ w_r).to(dtype).float())
    assert torch.equal(lin.weight.grad, (g_r.reshape(-1, 8).T @ x_r.reshape(-1, 16)).float())
    assert torch.equal(lin.bias.grad, g_r.sum((0, 1)).float())


def test_progress_without_tqdm_prints_every_tenth_step_and_the_last(tmp_path, monkeypatch, capsys):
    """The plain progress lines `minifloat compare` echoes from its child runs."""
    monkeypatch.setenv("MINIFLOAT_NO_TQDM", "1")
    t0 = time.perf_counter()
    train(_cfg(steps=12, eval_every=0, grad_accum=2), tmp_path / "run")
    wall = time.perf_counter() - t0
    lines = capsys.readouterr().out.splitlines()
    records = read_log(tmp_path / "run" / "log.jsonl")
    assert all(r["step_time_s"] > 0 for r in records) and sum(r["step_time_s"] for r in records) < wall
    assert all(r["tokens_per_s"] == pytest.approx(4 * 32 * 2 / r["step_time_s"], rel=1e-12) for r in records)
    assert [line.split()[:2] for line in lines] == [["step", "10/12"], ["step", "12/12"]]
    for line, rec in zip(lines, (records[9], records[11]), strict=True):
        assert line == f"step {rec['step']}/12 loss {rec['loss']:.4f} {rec['tokens_per_s']:.0f} tok/s"
    train(_cfg(steps=12, eval_every=0), tmp_path / "quiet", progress=False)
    assert capsys.readouterr().out == ""
    monkeypatch.delenv("MINIFLOAT_NO_TQDM")  # a terminal user's default: a tqdm bar on stderr
    train(_cfg(steps=3, eval_every=0), tmp_path / "bar")
    out, err = capsys.readouterr()
    assert out == "" and "3/3" in err and "loss=" in err and "tok_s=" in err


def test_gpt_is_causal_and_initialised_as_gpt2():
    """A token's logits depend on it and the tokens before it only; weights start at
    N(0, 0.02) with the residual projections at 0.02 / sqrt(2 · n_layer), biases at zero."""
    from minifloat.models.gpt import GPTConfig

    torch.manual_seed(0)
    c = GPTConfig(block_size=16, n_layer=3, n_head=2, n_embd=32)
    model = GPT(c)
    idx = torch.randint(0, 256, (2, 16))
    later = idx.clone()
    later[:, 9:] = (later[:, 9:] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(later)
    assert a.shape == (2, 16, 256)
    assert torch.equal(a[:, :9], b[:, :9]) and not torch.allclose(a[:, 9], b[:, 9])
    big = GPT(GPT_SIZES["small"])
    for name, p in big.named_parameters():
        if name.endswith("bias"):
            assert not p.any(), name
        elif name.endswith(("qkv.weight", "fc.weight", "wte.weight", "wpe.weight")):
            assert p.std().item() == pytest.approx(0.02, rel=0.02), name
        elif name.endswith("proj.weight"):
            assert p.std().item() == pytest.approx(0.02 / (2 * 4) ** 0.5, rel=0.02), name
    # Blocks 12·L·C² + 13·L·C, embeddings (V + T)·C, the final norm 2C; the head is tied.
    for size, (L, C, T, n) in {"tiny": (2, 64, 64, 120_576), "small": (4, 256, 128, 3_257_856),
                               "base": (6, 384, 256, 10_844_160)}.items():  # fmt: skip
        assert GPT(GPT_SIZES[size]).num_params() == 12 * L * C**2 + 13 * L * C + (256 + T) * C + 2 * C == n, size
    with pytest.raises(minifloat.MinifloatError, match="sequence of 17 tokens exceeds the model's block_size 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(minifloat.MinifloatError, match="n_embd=30 must be a multiple of n_head=4"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.n_layer = 5


def test_adamw_decays_matrices_only_and_only_fp16_scales_the_loss(tmp_path):
    """GPT-style AdamW (betas 0.9/0.95): weight decay on the ≥2-D weights, none on biases and
    norms; a dynamic loss scale for fp16 alone (every other precision trains at scale 1)."""
    names = {n: p.dim() for n, p in build_model(_cfg()).named_parameters()}
    for precision in ("fp32", "fp16", "fp8"):
        out = tmp_path / "nested" / precision  # --out's parents are created
        train(_cfg(precision=precision, steps=2, eval_every=0), out, progress=False)
        _, _, state = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(out / "checkpoints"))
        decay, no_decay = state["optimizer"]["param_groups"]
        assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
        assert sorted(decay["params"]) == sorted(n for n, d in names.items() if d >= 2)
        assert sorted(no_decay["params"]) == sorted(n for n, d in names.items() if d < 2)
        assert decay["betas"] == (0.9, 0.95) and decay["eps"] == 1e-8
        if precision == "fp16":
            assert state["scaler"]["scale"] > 1.0
        else:
            assert state["scaler"]["scale"] == 1.0


def test_activation_checkpointing_recomputes_each_block_and_changes_no_number():
    """Each block's forward runs again in backward; the gradients and a delayed-scaling
    layer's pending amaxes (max-folded, so a recompute records nothing new) are unchanged."""
    from minifloat.train.loop import _enable_activation_checkpointing

    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    results = []
    for on in (False, True):
        model = build_model(_cfg(precision="fp8"))
        calls = []
        for i, block in enumerate(model.blocks):
            block.ln1.register_forward_hook(lambda m, a, o, i=i, calls=calls: calls.append(i))
        if on:
            _enable_activation_checkpointing(model)
        model(x).logsumexp(-1).mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        results.append((calls, grads, model.blocks[0].mlp.fc.amax_pending.clone()))
    (calls_off, grads_off, amax_off), (calls_on, grads_on, amax_on) = results
    assert calls_off == [0, 1] and sorted(calls_on) == [0, 0, 1, 1]
    assert grads_on.keys() == grads_off.keys() and all(torch.equal(grads_on[n], grads_off[n]) for n in grads_on)
    assert torch.equal(amax_on, amax_off) and bool((amax_on > 0).all())


def test_compiled_and_checkpointed_training_equals_eager(tmp_path, monkeypatch):
    """--compile and --activation-checkpointing change how the step runs, not what it computes;
    the checkpoint holds the plain model's names (no torch.compile wrapper prefix)."""
    import minifloat.train.loop as loop

    enabled = []
    real = loop._enable_activation_checkpointing
    monkeypatch.setattr(loop, "_enable_activation_checkpointing", lambda m, *rest: enabled.append(m) or real(m, *rest))
    eager = train(_cfg(precision="fp8", steps=3), tmp_path / "eager", progress=False)
    assert enabled == []
    both = train(_cfg(precision="fp8", steps=3, compile=True, activation_checkpointing=True), tmp_path / "both", progress=False)
    assert len(enabled) == 1 and hasattr(enabled[0], "_orig_mod")  # the compiled model's blocks
    untimed = [{k: v for k, v in r["final"].items() if k not in ("step_time_s", "tokens_per_s")} for r in (both, eager)]
    assert _losses(tmp_path / "both") == _losses(tmp_path / "eager") and untimed[0] == untimed[1]
    _, weights, _ = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(tmp_path / "both" / "checkpoints"))
    _, eager_weights, _ = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(tmp_path / "eager" / "checkpoints"))
    assert weights.keys() == eager_weights.keys() and all(torch.equal(weights[k], eager_weights[k]) for k in weights)


def test_the_logged_loss_is_the_mean_cross_entropy_of_the_steps_micro_batches(tmp_path):
    """Step 1's loss from first principles: the seed's initial weights on the first two
    windows the seed's data generator draws (grad_accum 2)."""
    c = _cfg(steps=1, grad_accum=2, eval_every=0)
    train(c, tmp_path / "run", progress=False)
    losses = _window_losses(build_model(c), load_data(c).train, c, torch.Generator().manual_seed(c.seed), 2)
    assert read_log(tmp_path / "run" / "log.jsonl")[0]["loss"] == sum(loss / 2 for loss in losses)


def _window_losses(model, split, c, gen, n):
    """Cross entropy of `model` on each of the next `n` windows `gen` draws from `split`."""
    with torch.no_grad():
        batches = [get_batch(split, c.batch_size, c.seq_len, gen) for _ in range(n)]
        return [torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).item() for x, y in batches]


def test_bf16_uses_torch_autocast_where_the_cpu_has_bf16_units(tmp_path, monkeypatch):
    """Without BF16 units the GEMMs are emulated (RoundedLinear); with them, torch's CPU
    autocast runs plain Linears in BF16. Both compute a BF16 GEMM, so the losses agree closely."""
    from minifloat.measure.compare import recipe_description

    # both halves here, whatever this CPU has: the flags come from a cpuinfo file
    (tmp_path / "avx512").write_text("flags\t\t: fpu sse2 avx2 fma avx512f\n")
    (tmp_path / "amx").write_text("flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile\n")
    monkeypatch.setattr(support, "CPUINFO", str(tmp_path / "avx512"))
    emulated = build_model(_cfg(precision="bf16"))
    assert isinstance(emulated.blocks[0].mlp.fc, RoundedLinear) and type(emulated.lm_head) is torch.nn.Linear
    assert emulated.blocks[0].mlp.fc.rounding_dtype is torch.bfloat16
    assert build_model(_cfg(precision="fp16")).blocks[1].attn.qkv.rounding_dtype is torch.float16
    assert "operands rounded to the dtype" in recipe_description("bf16")["gemm"]
    train(_cfg(precision="bf16", steps=3), tmp_path / "emulated", progress=False)
    monkeypatch.setattr(support, "CPUINFO", str(tmp_path / "amx"))
    native = build_model(_cfg(precision="bf16"))
    assert not any(isinstance(m, RoundedLinear) for m in native.modules())
    assert "torch.autocast" in recipe_description("bf16")["gemm"]
    assert "operands rounded to the dtype" in recipe_description("fp16")["gemm"]  # no FP16 autocast on CPU
    train(_cfg(precision="bf16", steps=3), tmp_path / "native", progress=False)
    assert _losses(tmp_path / "native") == pytest.approx(_losses(tmp_path / "emulated"), abs=0.02)
    assert _losses(tmp_path / "native") != _losses(tmp_path / "emulated")
    train(_cfg(precision="fp32", steps=3), tmp_path / "fp32", progress=False)
    assert _losses(tmp_path / "native") != _losses(tmp_path / "fp32")  # autocast did run in BF16


def test_two_micro_batches_of_two_step_as_one_batch_of_four(tmp_path):
    """Gradient accumulation averages: the data generator draws the same four windows either
    way, so the loss and the gradient norm of each step match to rounding."""
    train(_cfg(steps=3, batch_size=4, eval_every=2), tmp_path / "one", progress=False)
    train(_cfg(steps=3, batch_size=2, grad_accum=2, eval_every=0), tmp_path / "two", progress=False)
    one, two = read_log(tmp_path / "one" / "log.jsonl"), read_log(tmp_path / "two" / "log.jsonl")
    assert [r["step"] for r in one if "val_loss" in r] == [2, 3]  # every 2 steps and after the last
    assert not any("val_loss" in r for r in two)  # --eval-every 0: never
    assert not any(r["nonfinite"] or r["skipped"] for r in one + two) and two[-1]["skipped_steps"] == 0
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def test_grad_clip_zero_means_off_and_the_default_clip_changes_the_step(tmp_path):
    for name, clip in (("off", 0.0), ("huge", 1e9), ("default", 1.0)):
        train(_cfg(steps=3, eval_every=0, grad_clip=clip), tmp_path / name, progress=False)
    off, huge, default = (read_log(f"{tmp_path}/{name}/log.jsonl") for name in ("off", "huge", "default"))
    assert [r["loss"] for r in off] == [r["loss"] for r in huge]  # 0: no clipping at all
    assert off[0]["grad_norm"] > 1.0 and off[0]["grad_norm"] == default[0]["grad_norm"]  # logged before clipping
    assert [r["loss"] for r in default][1:] != [r["loss"] for r in off][1:]


def test_validation_loss_is_the_mean_over_fixed_held_out_windows(tmp_path):
    """`evaluate` from first principles (eval_batches windows of the validation split, drawn
    from a generator seeded 10 000 + seed whatever the step), and the log's val_loss is it for
    the trained weights."""
    c = _cfg(steps=2, eval_every=2, eval_batches=3, seed=5)
    train(c, tmp_path / "run", progress=False)
    _, weights, _ = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(tmp_path / "run" / "checkpoints"))
    model, data = build_model(c), load_data(c)
    model.load_state_dict(weights, strict=False)
    losses = _window_losses(model, data.val, c, torch.Generator().manual_seed(10_005), 3)
    assert evaluate(model, data.val, c) == pytest.approx(sum(losses) / 3, rel=1e-12)
    assert read_log(tmp_path / "run" / "log.jsonl")[-1]["val_loss"] == pytest.approx(sum(losses) / 3, rel=1e-12)
    assert model.training  # evaluate puts the model back in training mode


def test_fsdp_outside_torchrun_says_how_to_launch_it(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(minifloat.MinifloatError, match="--fsdp runs under torchrun, e.g.: torchrun --nproc_per_node 2"):
        train(_cfg(fsdp=True), tmp_path / "run", progress=False)
