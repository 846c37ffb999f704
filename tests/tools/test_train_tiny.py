"""tools/train_tiny on the CPU: corpus rules, the tokenizer, a micro training run with resume, the export
(transformers and deltaserve both load it), the Eagle3 head and its training, and `evaluate`."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `tools` is a namespace package at the repository root
    sys.path.insert(0, str(ROOT))

from deltaserve.model.eagle3 import (  # noqa: E402
    Eagle3Config,
    Eagle3Head,
    Eagle3KVCache,
    default_tap_layers,
    load_eagle3,
    save_eagle3,
)
from deltaserve.model_files.tokenizer import load_tokenizer, special_token_ids  # noqa: E402
from tools.train_tiny import bpe, corpus  # noqa: E402
from tools.train_tiny.checkpoint import export_pretrained, load_state  # noqa: E402
from tools.train_tiny.data import BatchSampler, load_tokens  # noqa: E402
from tools.train_tiny.evaluate import EvalArgs, evaluate  # noqa: E402
from tools.train_tiny.metrics import heldout_loss  # noqa: E402
from tools.train_tiny.models import build_model, load_model, shape_config  # noqa: E402
from tools.train_tiny.prepare import prepare  # noqa: E402
from tools.train_tiny.train import TrainArgs, train  # noqa: E402
from tools.train_tiny.train_eagle3 import Eagle3Args, train_eagle3  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the trainers use one CPU thread (runtime.configure_cpu_threads); give the others theirs back after
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# corpus ---------------------------------------------------------------------------------------------
def _write(root: Path, rel: str, text: str | bytes) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())


def test_corpus_rules_on_a_synthetic_stdlib(tmp_path):
    keep = ["abc.py", "json/decoder.py", "encodings/utf_8.py", "idlelib/config.py", "lib2to3/fixes/fix_ne.py"]
    drop = {
        "test/test_abc.py": "dir:test", "lib2to3/tests/test_all.py": "dir:tests",
        "idlelib/idle_test/test_x.py": "dir:idle_test", "site-packages/pkg/mod.py": "dir:site-packages",
        "pydoc_data/topics.py": "data_dir", "ensurepip/_bundled/x.py": "data_dir",
        "config-3.11-x86_64-linux-gnu/python-config.py": "build_config",
        "_sysconfigdata__linux_x86_64-linux-gnu.py": "generated_sysconfigdata",
        "encodings/cp1252.py": "codec_table", "latin1.py": "not_utf8",
    }
    for rel in keep:
        _write(tmp_path, rel, f"# {rel}\nx = 1\n")
    for rel in drop:
        _write(tmp_path, rel, "decoding_table = ()\n")
    _write(tmp_path, "latin1.py", b"s = '\xe9'\n")
    _write(tmp_path, "notes.txt", "not python")
    files, excluded = corpus.select_files(str(tmp_path))
    assert [f.relpath for f in files] == sorted(keep)
    for f in files:
        assert f.sha256 == hashlib.sha256((tmp_path / f.relpath).read_bytes()).hexdigest()
        assert f.split == corpus.split_of(f.relpath)
    for rel, reason in drop.items():
        assert corpus.exclusion_reason(rel, None if rel == "latin1.py" else "decoding_table = ()") == reason
    assert excluded["dir:test"] == 1 and excluded["codec_table"] == 1
    assert corpus.select_files(str(tmp_path)) == (files, excluded)


def test_corpus_on_this_interpreter_is_deterministic_and_has_no_tests(tmp_path):
    files, _ = corpus.select_files(corpus.stdlib_dir())
    assert files == corpus.select_files(corpus.stdlib_dir())[0]
    assert len(files) > 100
    for f in files:
        parts = f.relpath.split("/")
        assert not set(parts[:-1]) & {"test", "tests", "idle_test", "site-packages"}, f.relpath
        assert not f.relpath.startswith(("pydoc_data/", "ensurepip/_bundled/"))
    val = [f for f in files if f.split == corpus.VAL]
    assert 0.01 < len(val) / len(files) < 0.06
    summary = corpus.write_manifest(files, {}, corpus.stdlib_dir(), str(tmp_path / "list.txt"), 300)
    text = (tmp_path / "list.txt").read_text()
    assert summary["list_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert json.loads((tmp_path / "list.json").read_text())["num_files"] == len(files)


def test_committed_corpus_list_matches_its_hash():
    txt = ROOT / "tools" / "train_tiny" / "corpus_files.txt"
    meta = json.loads(txt.with_suffix(".json").read_text())
    assert hashlib.sha256(txt.read_bytes()).hexdigest() == meta["list_sha256"]
    lines = txt.read_text().splitlines()
    assert len(lines) == meta["num_files"]
    assert [ln.split("  ")[3] for ln in lines] == sorted(ln.split("  ")[3] for ln in lines)


# tokenizer ------------------------------------------------------------------------------------------
TEXTS = ["def f(x):\n    return x + 1\n", "héllo 世界 🎉\r\n\ttabs  ", "", "class A:\n    pass\n"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tok"))
    stdlib = Path(corpus.stdlib_dir())
    texts = [(stdlib / name).read_text() for name in ("abc.py", "json/decoder.py")]
    tok = bpe.train_bpe([*texts, *TEXTS], vocab_size=300)
    bpe.save_hf_tokenizer(tok, out, model_max_length=1024)
    return out


def test_tokenizer_round_trips_and_has_specials_and_template(tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert tok.encode("x", add_special_tokens=True) == tok.encode("x", add_special_tokens=False)
    assert [tok.convert_tokens_to_ids(t) for t in bpe.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert tok.encode("a<|eos|>b", add_special_tokens=False)[1] == 1
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    cfg = json.loads(Path(tok_dir, "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == bpe.CHAT_TEMPLATE
    assert json.loads(Path(tok_dir, "special_tokens_map.json").read_text())["eos_token"] == bpe.EOS
    ours = load_tokenizer(tok_dir)
    assert tuple(special_token_ids(ours)) == (0, 1, 2)
    assert len(ours) == 300


# micro training ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("data"))
    meta = prepare(out, vocab_size=320, max_files=4)
    assert meta["vocab_size"] <= 320 and meta["eos_token_id"] == 1
    return out


def _micro_args(data: str, out: str, **kw) -> TrainArgs:
    base = dict(data=data, out=out, model="micro", batch_size=2, seq_len=32, lr=1e-2, warmup_steps=2,
                max_steps=8, eval_every=4, eval_windows=2, ckpt_every=4, log_every=2, device="cpu")
    return TrainArgs(**{**base, **kw})


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("run_a"))
    summary = train(_micro_args(data_dir, out))
    return out, summary


def test_sampler_is_deterministic_and_resumable(data_dir):
    tokens = load_tokens(data_dir, "train")
    a, b = BatchSampler(tokens, 2, 16, seed=3), BatchSampler(tokens, 2, 16, seed=3)
    first = [a.next_batch()[0] for _ in range(3)]
    b.load_state_dict({"epoch": 0, "cursor": 4})
    assert torch.equal(b.next_batch()[0], first[2])
    x, y = a.next_batch()
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_micro_training_lowers_the_loss(trained, data_dir):
    out, summary = trained
    assert summary["status"] == "done" and summary["step"] == 8
    meta = json.loads(Path(data_dir, "meta.json").read_text())
    fresh = build_model(shape_config("micro", meta["vocab_size"], 0, 1, 2), seed=1234)
    before, _ = heldout_loss(fresh, load_tokens(data_dir, "val"), 32, 2, CPU, "fp32", max_windows=2)
    history = json.loads(Path(out, "loss_curve.json").read_text())
    assert history[-1]["step"] == 8 and before - history[-1]["val_loss"] > 0.3
    assert meta["num_tokens"]["val"] > 0 and os.path.isfile(os.path.join(out, "loss_curve.csv"))


def test_resume_reaches_the_same_state(trained, data_dir, tmp_path):
    out_a, _ = trained
    out_b = str(tmp_path / "run_b")
    paused = train(_micro_args(data_dir, out_b, stop_after_steps=3))
    assert paused["status"] == "paused" and paused["step"] == 3
    with pytest.raises(ValueError, match="seq-len"):
        train(_micro_args(data_dir, out_b, seq_len=16, resume=True))
    done = train(_micro_args(data_dir, out_b, resume=True))
    assert done["status"] == "done" and done["step"] == 8
    a, b = load_state(out_a), load_state(out_b)
    assert a["sampler"] == b["sampler"]
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        torch.testing.assert_close(a["model"][name], b["model"][name], rtol=0, atol=0, msg=name)
    assert a["loop"]["history"][-1]["val_loss"] == b["loop"]["history"][-1]["val_loss"]


def test_export_loads_in_transformers_and_deltaserve(trained, data_dir, tmp_path):
    from deltaserve import LLM, SamplingParams
    from deltaserve.config.model_config import KimiLinearConfig

    out, summary = trained
    export = summary["export"]
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(
        os.listdir(export)
    )
    sharded = str(tmp_path / "sharded")
    source = load_model(export)
    files = export_pretrained(source, sharded, os.path.join(data_dir, "tokenizer"), max_shard_size="100KB")
    assert "model.safetensors.index.json" in files
    for name in (export, sharded):
        hf = load_model(name)
        for (n, p), (_, q) in zip(hf.named_parameters(), source.named_parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
        config = KimiLinearConfig.from_pretrained(name)
        assert config.layer_types == ("linear_attention", "linear_attention", "full_attention")
        assert config.eos_token_id == (1,) and config.num_experts == 4
        llm = LLM(model=name, device="cpu", dtype="float32")
        result = llm.generate(["def add(a, b):\n"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                              use_tqdm=False)[0]
        assert len(result.outputs[0].token_ids) == 5
    state = json.loads(Path(export, "config.json").read_text())
    assert state.get("dtype", state.get("torch_dtype")) == "bfloat16"


# eagle3 ---------------------------------------------------------------------------------------------
def _head(**kw) -> Eagle3Head:
    base = dict(vocab_size=40, hidden_size=16, target_hidden_size=12, tap_layer_ids=(0, 2, 3), num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, intermediate_size=24, target_num_hidden_layers=4)
    torch.manual_seed(0)
    return Eagle3Head(Eagle3Config(**{**base, **kw}))


def test_eagle3_shapes_and_config():
    head = _head()
    x = torch.randint(0, 40, (2, 7))
    fused = head.fuse(torch.randn(2, 7, 36))
    assert fused.shape == (2, 7, 16)
    out = head(x, fused, torch.arange(7).expand(2, 7))
    assert out.shape == (2, 7, 16) and head.compute_logits(out).shape == (2, 7, 40)
    steps = head.forward_ttt(x, fused, 3)
    assert len(steps) == 3 and all(s.shape == (2, 7, 40) and torch.isfinite(s).all() for s in steps)
    assert default_tap_layers(8) == (2, 4, 5) and default_tap_layers(3) == (0, 1, 2)
    with pytest.raises(ValueError, match="tap layer 4"):
        _head(tap_layer_ids=(1, 4))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        _head(num_key_value_heads=3)


def test_eagle3_ttt_matches_step_by_step_decoding():
    head = _head().double()
    x = torch.randint(0, 40, (2, 9))
    fused = head.fuse(torch.randn(2, 9, 36, dtype=torch.float64))
    steps = head.forward_ttt(x, fused, 3)
    t = 4  # draft from index t: step 0 over indices 0..t, then one entry per drafted token
    cache = Eagle3KVCache()
    out = head(x[:, 1 : t + 2], fused[:, : t + 1], torch.arange(t + 1).expand(2, -1), cache)
    torch.testing.assert_close(head.compute_logits(out), steps[0][:, : t + 1], rtol=1e-10, atol=1e-10)
    hidden = out[:, t : t + 1]
    for k in (1, 2):
        hidden = head(x[:, t + 1 + k : t + 2 + k], hidden, torch.full((2, 1), t + k), cache)
        torch.testing.assert_close(head.compute_logits(hidden)[:, 0], steps[k][:, t], rtol=1e-10, atol=1e-10)
    assert cache.length == t + 3


def test_eagle3_save_load_round_trip(tmp_path):
    head = _head()
    save_eagle3(head, str(tmp_path))
    loaded = load_eagle3(str(tmp_path))
    assert loaded.config == head.config
    for (n, p), (_, q) in zip(loaded.state_dict().items(), head.state_dict().items(), strict=True):
        torch.testing.assert_close(p, q.bfloat16().float(), rtol=0, atol=0, msg=n)


def test_eagle3_training_and_evaluate(trained, data_dir, tmp_path):
    _, summary = trained
    out = str(tmp_path / "eagle3")
    args = Eagle3Args(data=data_dir, target=summary["export"], out=out, batch_size=2, seq_len=32, lr=3e-3,
                      warmup_steps=1, max_steps=4, eval_every=4, eval_windows=2, log_every=2, ttt_steps=2,
                      device="cpu")
    result = train_eagle3(args)
    assert result["status"] == "done" and result["head_config"]["tap_layer_ids"] == [0, 1, 2]
    history = result["heldout"]
    assert 0 <= history["acc_1"] <= 1 and history["chain_1"] <= history["chain_0"]
    assert history["expected_accepted"] == pytest.approx(history["chain_0"] + history["chain_1"])
    head = load_eagle3(result["export"])
    assert head.config.vocab_size == json.loads(Path(data_dir, "meta.json").read_text())["vocab_size"]
    report = evaluate(EvalArgs(data=data_dir, model=summary["export"], draft=summary["export"], eagle3=out,
                               out=str(tmp_path / "eval.json"), seq_len=32, batch_size=2, max_windows=2,
                               completions=1, max_new_tokens=3, device="cpu"))
    assert report["target"]["val_loss_nats_per_token"] < report["unigram_baseline"]["val_loss_nats_per_token"] + 2
    assert report["draft"]["top1_agreement_with_target"] == 1.0
    assert set(report["eagle3"]) >= {"acc_0", "acc_1", "expected_accepted"}
    assert json.loads((tmp_path / "eval.json").read_text())["target"]["val_bits_per_byte"] > 0
