"""Bad input (issue 3 item 5): every mistake a user can fix exits with code 2 and one message naming the problem,
and writes nothing (no new run folder, an existing one untouched); failures inside a run (rewards, NaN, OOM, a full
disk) are survived or reported with what to change."""
from __future__ import annotations

import errno
import json

import pytest
import torch
from conftest import FAST, VARIED, adapter_weights, cli_main, sets, snapshot, step_records


def _bad(capsys, tmp_path, *overrides, words=()):
    """Run `train` with the overrides; assert exit 2, the words in the message, and no run folder written."""
    out = tmp_path / "new-run"
    rc = cli_main("train", "--preset", "smoke", *sets(overrides), "--output", str(out), "--no-progress")
    err = capsys.readouterr().err
    assert rc == 2, err
    msgs = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(msgs) == 1, err  # one message (progress bars of model loading may come before it)
    err = msgs[0]
    for w in words:
        assert w in err, (w, err)
    assert not out.exists(), f"{out} was created: {list(out.rglob('*'))}"
    return err


# ---------------------------------------------------------------------------------------------------------------
# configuration


def test_unknown_config_key(capsys, tmp_path):
    from dataclasses import fields

    from basis_lite.config import TrainConfig

    err = _bad(capsys, tmp_path, "train.stepz=3", words=("train.stepz",))
    assert all(f.name in err for f in fields(TrainConfig))  # lists what is accepted


def test_wrong_type(capsys, tmp_path):
    _bad(capsys, tmp_path, "train.steps=abc", words=("train.steps", "integer", "abc"))


def test_bad_choice_lists_accepted(capsys, tmp_path):
    from basis_lite.config import CHOICES

    err = _bad(capsys, tmp_path, "estimator.name=foo", words=("estimator.name", "foo"))
    assert all(c in err for c in CHOICES["estimator.name"])


def test_grpo_needs_more_than_one_rollout(capsys, tmp_path):
    _bad(capsys, tmp_path, "estimator.name=grpo", "estimator.rollouts_per_prompt=1",
         words=("grpo", "rollouts_per_prompt"))


def test_4bit_without_bitsandbytes(capsys, tmp_path, monkeypatch):
    import basis_lite.model.loading

    monkeypatch.setattr(basis_lite.model.loading, "bnb_available", lambda: False)
    _bad(capsys, tmp_path, *FAST, "model.load_in_4bit=true", words=("load_in_4bit", "bitsandbytes"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_without_gpu(capsys, tmp_path):
    _bad(capsys, tmp_path, *FAST, "device=cuda", words=("cuda", "device=cpu"))


def test_reward_function_that_does_not_exist(capsys, tmp_path):
    _bad(capsys, tmp_path, *FAST, "reward.functions=[tests.reward_fns:no_such_fn]",
         words=("tests.reward_fns:no_such_fn", "no attribute"))
    _bad(capsys, tmp_path, *FAST, "reward.functions=[no_such_module_xyz:f]", words=("no_such_module_xyz", "not found"))


def test_existing_run_folder_without_resume(capsys, smoke_run):
    run = smoke_run.run_dir
    before = snapshot(run)
    rc = cli_main("train", "--preset", "smoke", *sets(FAST), "--output", str(run), "--no-progress")
    err = capsys.readouterr().err
    assert rc == 2 and "already holds a run" in err and "--resume" in err
    assert snapshot(run) == before


# ---------------------------------------------------------------------------------------------------------------
# data files


def _rows(n, start=0):
    return [json.dumps({"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)}) for i in range(start, start + n)]


def _write(path, good_lines, bad_lines=()):
    data = b"\n".join([line.encode() for line in good_lines] + list(bad_lines)) + b"\n"
    path.write_bytes(data)
    return path


BAD_LINES = [json.dumps({"question": "What is 1 + 1?"}).encode(),  # answer missing
             json.dumps({"question": "  ", "answer": "3"}).encode(),  # empty question
             b'{"question": "What is \xff\xfe?", "answer": "4"}']  # not UTF-8


def test_dataset_with_too_many_bad_rows(capsys, tmp_path):
    path = _write(tmp_path / "probs.jsonl", _rows(30), BAD_LINES)  # 3 of 33 > 5%
    err = _bad(capsys, tmp_path, *FAST, f"data.dataset={path}", words=(str(path), "3 of 33", "max_bad_fraction"))
    for why in ("'answer' missing", "'question' empty", "not valid UTF-8"):
        assert why in err, why


def test_dataset_with_few_bad_rows_runs_and_says_how_many_were_skipped(capsys, caplog, tmp_path):
    path = _write(tmp_path / "probs.jsonl", _rows(60), BAD_LINES[2:])  # 1 of 61 < 5%
    run = tmp_path / "run"
    rc = cli_main("train", "--preset", "smoke", *sets(FAST + [f"data.dataset={path}", "train.steps=1"]),
                  "--output", str(run), "--no-progress")
    assert rc == 0, capsys.readouterr().err
    assert "skipped 1 of 61 rows" in caplog.text and str(path) in caplog.text
    assert len(step_records(run)) == 1


def test_a_directory_as_the_dataset_says_so(capsys, tmp_path):
    folder = tmp_path / "mydata"
    folder.mkdir()
    _write(folder / "train.jsonl", _rows(10))
    _bad(capsys, tmp_path, *FAST, f"data.dataset={folder}", words=(str(folder), "is a directory", "train.jsonl"))
    named = tmp_path / "looks-like.jsonl"  # a folder with a data file's name
    named.mkdir()
    _bad(capsys, tmp_path, *FAST, f"data.dataset={named}", words=(str(named), "is a directory", "holds no"))


def test_a_10mb_row_is_cut_before_tokenizing(caplog, tmp_path):
    """A 10 MB single-line question is cut to data.max_question_chars when loaded (its end kept), so no tokenizer
    ever sees 10 MB (measured before: 9.6 GB of RAM); a 10 MB gold answer makes its row a bad row."""
    from basis_lite.config import load_config
    from basis_lite.data import load_examples
    from basis_lite.data.rows import MAX_GOLD_CHARS

    huge_q = "Ignore this. " * 800_000 + "What is 2 + 3?"
    lines = _rows(80) + [json.dumps({"question": huge_q, "answer": "5"}),
                         json.dumps({"question": "What is 1 + 0?", "answer": "1" * 10_000_000})]
    path = _write(tmp_path / "huge.jsonl", lines)
    assert path.stat().st_size > 20_000_000
    cfg = load_config("smoke", [f"data.dataset={path}", "data.eval_size=4", "data.train_size=0"])
    examples = load_examples(cfg.data, "train") + load_examples(cfg.data, "eval")
    assert len(examples) == 81  # every good row, the cut one too
    assert max(len(ex.question) for ex in examples) <= cfg.data.max_question_chars
    (cut,) = [ex for ex in examples if ex.answer == "5" and "Ignore this" in ex.question]
    assert cut.question.endswith("What is 2 + 3?")
    assert all(len(ex.answer) <= MAX_GOLD_CHARS for ex in examples)
    assert "cut 1 question(s) longer than data.max_question_chars=20000" in caplog.text
    assert "longer than 2000 characters" in caplog.text  # the 10 MB answer's row, skipped and counted


def test_unparseable_gold_answers_are_reported(capsys, tmp_path):
    lines = _rows(30) + [json.dumps({"question": f"Name {i}?", "answer": "???"}) for i in range(10)]
    path = _write(tmp_path / "gold.jsonl", lines)
    _bad(capsys, tmp_path, *FAST, f"data.dataset={path}", words=(str(path), "cannot parse", "'???'"))


# ---------------------------------------------------------------------------------------------------------------
# failures inside a run


def test_reward_function_that_fails_after_working_does_not_stop_the_run(capsys, caplog, tmp_path):
    """Step 1: both functions work. Step 2: one raises, one hangs past the timeout (its worker is replaced): each
    scores 0 with a warning and the run goes on."""
    run = tmp_path / "run"
    fns = "reward.functions=[tests.reward_fns:raises_after_first, tests.reward_fns:hangs_after_first]"
    rc = cli_main("train", "--preset", "smoke", *sets(FAST), "--set", fns, "--set", "reward.timeout_s=1",
                  "--set", "train.steps=2", "--output", str(run), "--no-progress")
    assert rc == 0, capsys.readouterr().err
    assert [r["reward_warnings"] for r in step_records(run)] == [0, 2]  # one failure each, at step 2
    assert "deliberate failure after a good first call" in caplog.text and "timed out after 1 s" in caplog.text
    assert json.loads((run / "summary.json").read_text())["reward_warnings"] == 2


@pytest.mark.parametrize("timeout", ["0", "5"])  # in the trainer process / in the reward worker
def test_reward_function_failing_on_its_first_call_stops_the_run(capsys, tmp_path, timeout):
    """Training on the zeros of a function that never worked is silent garbage: exit 2 with its message."""
    run = tmp_path / "run"
    rc = cli_main("train", "--preset", "smoke", *sets(FAST), "--set", "reward.functions=[tests.reward_fns:always_raises]",
                  "--set", f"reward.timeout_s={timeout}", "--set", "train.steps=1", "--output", str(run),
                  "--no-progress")
    err = capsys.readouterr().err
    assert rc == 2, err
    assert ("error: reward function tests.reward_fns:always_raises failed on its first call: raised ValueError: "
            "always_raises: deliberate failure") in err
    assert not (run / "adapter").exists() and not list(run.glob("checkpoints/step-*"))


def test_reward_signature_is_checked_before_anything_is_written(capsys, tmp_path):
    err = _bad(capsys, tmp_path, *FAST, "reward.functions=[tests.reward_fns:needs_solution]",
               "reward.timeout_s=5", words=("tests.reward_fns:needs_solution", "'solution'", "gets no value",
                                            "answer", "level"))
    assert "completion_ids" in err


@pytest.mark.parametrize("override,words", [
    ("train.max_grad_norm=-1", ("train.max_grad_norm", "-1.0", "a number > 0")),
    ("lora.alpha=0", ("lora.alpha", "got 0", "an integer > 0")),
    ("lora.dropout=5", ("lora.dropout", "5.0", "[0, 1)")),
    ("train.lr=.nan", ("train.lr", "nan", "a number > 0")),
    ("generation.top_k=-5", ("generation.top_k", "-5", "[-1, 10000000]")),
    ("train.logprob_chunk_size=0", ("train.logprob_chunk_size", "got 0", "[1, 16777216]")),
    ("estimator.options={bandwith: 0.3}", ("estimator.options.bandwith", "did you mean bandwidth?")),
    ("estimator.options={bandwidth: -1}", ("estimator.options.bandwidth", "-1", "positive number")),
])
def test_settings_that_would_train_wrong_exit_2_before_any_work(capsys, tmp_path, override, words):
    _bad(capsys, tmp_path, override, words=words)


def _cfg(*overrides):
    from basis_lite.config import load_config

    return load_config("smoke", list(VARIED) + list(overrides))


def test_nan_loss_skips_the_step_then_aborts(tmp_path, monkeypatch, caplog):
    import basis_lite.losses.policy as losses
    import basis_lite.trainer as trainer

    real = losses.get_policy_loss("ppo_clip")

    def nan_loss(batch, opts):
        per_token, stats = real(batch, opts)
        return per_token * float("nan"), stats

    monkeypatch.setitem(losses._LOSS_FNS, "ppo_clip", nan_loss)  # the registered default loss
    run = tmp_path / "run"
    cfg = _cfg("train.steps=5", "train.max_bad_steps=2", "train.save_every=1")
    with pytest.raises(trainer.TrainingAborted, match=r"2 skipped steps in a row at step 2.*non-finite loss.*Lower train\.lr"):
        trainer.train(cfg, run, progress=False)
    recs = step_records(run)
    assert [(r["step"], r["skipped"]) for r in recs] == [(1, True)]  # the aborting step 2 raises before its line
    assert "non-finite loss" in caplog.text and "step skipped" in caplog.text
    # the skipped update left the adapter as it was: lora_B still exactly 0, nothing NaN
    w = adapter_weights(run / "checkpoints" / "step-000001" / "adapter")
    assert all(torch.isfinite(t).all() for t in w.values())
    assert all(t.abs().max() == 0 for k, t in w.items() if "lora_B" in k)


def test_fake_cuda_oom_at_the_gpu_boundary_suggests_a_smaller_micro_batch(tmp_path, monkeypatch):
    """A fake: policy_update raises torch.OutOfMemoryError as CUDA would (no GPU here)."""
    import basis_lite.trainer as trainer

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(trainer, "policy_update", oom)
    cfg = _cfg("train.steps=2", "train.micro_batch_size=4")
    with pytest.raises(trainer.TrainingAborted) as e:
        trainer.train(cfg, tmp_path / "run", progress=False)
    msg = str(e.value)
    assert "out of memory" in msg and "train.micro_batch_size=4" in msg
    assert f"--set train.micro_batch_size={cfg.train.micro_batch_size // 2}" in msg


def test_disk_full_while_checkpointing_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file

    import basis_lite.runs.checkpoint as ckpt

    real_save = ckpt.save_file
    calls = []

    def save(tensors, f, *args, **kwargs):
        calls.append(str(f))
        if len(calls) == 2:  # the second checkpoint's state.safetensors
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(tensors, f, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_file", save)
    run = tmp_path / "run"
    rc = cli_main("train", "--preset", "smoke", *sets(VARIED), "--set", "train.steps=3", "--set", "train.save_every=1",
                  "--output", str(run), "--no-progress")
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "space" in err.lower() and str(run / "checkpoints") in err and "step-000001" in err
    assert len(calls) == 2 and ".tmp-step-000002" in calls[1]
    ck = run / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-000001"]  # no .tmp folder left behind
    assert ckpt.latest_checkpoint(run) == ck / "step-000001"
    state = ckpt.load_state(ck / "step-000001")
    assert state["step"] == 1 and state["optimizer"]["state"]
    w = load_file(str(ck / "step-000001" / "adapter" / "adapter_model.safetensors"))
    assert w and all(torch.isfinite(t).all() for t in w.values())
    assert any(t.abs().max() > 0 for k, t in w.items() if "lora_B" in k)  # one real update is in it
    assert not (run / "adapter").exists()
