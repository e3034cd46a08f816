"""gpt.py --export_hf DIR --init_from CKPT: a checkpoint of this project in the Hugging Face GPT-2 layout, read back by
transformers (the model and its tokenizer) and by every script's --init_from."""

import sys

import pytest
import torch
from conftest import bpe_checkpoint, char_checkpoint, needs_bpe, run_script

import gpt

CHARS = "\n !',-.:?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def export(monkeypatch, *args):
    """gpt.py's main() in this process; returns the exit code (0 when it returned)."""
    monkeypatch.setattr(sys, "argv", ["gpt.py", *map(str, args)])
    try:
        gpt.main()
    except SystemExit as e:
        return e.code
    return 0


def our_model(path):
    model, spec, _ = gpt.load_model(str(path))
    return model.eval(), spec


def test_a_char_checkpoint_exports_to_a_gpt2_model_with_our_logits_and_a_char_tokenizer(tmp_path, monkeypatch, capsys):
    """transformers' GPT2LMHeadModel on the export gives our logits (1e-4) on the same tokens, with and without a
    batch mate, and AutoTokenizer encodes and decodes text exactly as the checkpoint's char vocabulary does."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    init = char_checkpoint(tmp_path / "ckpt.pt", CHARS, block_size=32, seed=3)
    assert export(monkeypatch, "--export_hf", tmp_path / "hf", "--init_from", init) == 0
    assert "GPT2LMHeadModel.from_pretrained" in capsys.readouterr().out
    ours, _ = our_model(init)
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    idx = torch.randint(0, len(CHARS), (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx)[0], atol=1e-4, rtol=1e-4)
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "ROMEO:\nBut, soft! what light?\n\n"
    ids = [CHARS.index(c) for c in text]
    assert tok(text)["input_ids"] == ids
    assert tok.decode(ids) == text


@needs_bpe
def test_a_bpe_export_loads_back_as_the_same_model_and_tokenizes_as_tiktoken(tmp_path, monkeypatch):
    """--init_from DIR (every script's Hugging Face folder path) on the export gives back the same weights and the
    gpt2 tokenizer; AutoTokenizer on the export gives tiktoken's GPT-2 ids, <|endoftext|> included."""
    import tiktoken
    from transformers import AutoTokenizer, GPT2LMHeadModel

    init = bpe_checkpoint(tmp_path / "ckpt.pt", block_size=32, seed=1)
    assert export(monkeypatch, "--export_hf", tmp_path / "hf", "--init_from", init) == 0
    ours, _ = our_model(init)
    back, spec = our_model(tmp_path / "hf")
    assert spec == "gpt2"
    for (key, a), (key_back, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert key == key_back and torch.equal(a, b), key
    idx = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf_logits = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()(idx).logits
        torch.testing.assert_close(hf_logits, ours(idx)[0], atol=1e-4, rtol=1e-4)
    enc = tiktoken.get_encoding("gpt2")
    text = "Human: what is 12+34?<|endoftext|>\n\nAssistant:  46, naïvely."
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(text)["input_ids"] == enc.encode(text, allowed_special="all")


def test_a_reward_model_exports_its_body_and_says_so(tmp_path, monkeypatch, capsys):
    init = char_checkpoint(tmp_path / "rm.pt", CHARS, block_size=32, reward_head=True)
    assert export(monkeypatch, "--export_hf", tmp_path / "hf", "--init_from", init) == 0
    assert "only its GPT body" in capsys.readouterr().out
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def variant_checkpoint(path, **variant):
    """A tiny gpt.py variant checkpoint (MLA or denoise), as gpt.py writes its model_config."""
    config = {"block_size": 16, "vocab_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 16, "dropout": 0.0, "bias": True}
    model = gpt.make_model({**config, **variant})
    torch.save({"model": model.state_dict(), "model_config": {**config, **variant}, "tokenizer": "gpt2"}, path)
    return path


@pytest.mark.parametrize("case", ["no_init_from", "folder_not_empty", "mla", "denoise", "missing_checkpoint"])
def test_bad_export_inputs_exit_2_with_one_line_and_write_nothing(case, tmp_path, monkeypatch, capsys):
    init = char_checkpoint(tmp_path / "ckpt.pt", CHARS, block_size=32)
    out = tmp_path / "hf"
    args = ["--export_hf", out, "--init_from", init]
    needle = "--export_hf"
    if case == "no_init_from":
        args = ["--export_hf", out]
    elif case == "folder_not_empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        needle = "not empty"
    elif case == "mla":
        args[-1] = variant_checkpoint(tmp_path / "mla.pt", attention="mla", kv_latent_dim=8)
        needle = "mla"
    elif case == "denoise":
        args[-1] = variant_checkpoint(tmp_path / "denoise.pt", objective="denoise")
        needle = "denoise"
    else:
        args[-1] = tmp_path / "nothing.pt"
        needle = "nothing.pt"
    assert export(monkeypatch, *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    expected = ["keep.txt"] if case == "folder_not_empty" else None
    assert (sorted(p.name for p in out.iterdir()) if out.exists() else None) == expected


@pytest.mark.slow
def test_export_runs_as_a_command(tmp_path):
    """The command the README gives, in a real process: exit 0, the three files transformers needs."""
    init = char_checkpoint(tmp_path / "ckpt.pt", CHARS, block_size=32)
    proc = run_script("gpt.py", "--export_hf", tmp_path / "hf", "--init_from", init)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "hf").iterdir()}


def test_generate_on_an_exported_char_model_stops_at_the_newline(tmp_path, monkeypatch):
    """The export's config and generation config name the end of an answer (a char model's newline; GPT-2 BPE's
    <|endoftext|>, 50256), so transformers' generate() stops there, as our generate() does with that eos_id."""
    from transformers import GPT2LMHeadModel

    init = char_checkpoint(tmp_path / "ckpt.pt", CHARS, block_size=32, seed=3)
    ours, _ = our_model(init)
    newline = CHARS.index("\n")
    with torch.no_grad():  # the final hidden state becomes a constant that only the newline's embedding matches
        ours.transformer.ln_f.weight.zero_()
        ours.transformer.ln_f.bias.zero_()
        ours.transformer.ln_f.bias[0] = 1.0
        ours.transformer.wte.weight[newline, 0] = 10.0  # tied to lm_head: the newline's logit is 10, the others ~0
    ckpt = torch.load(init, weights_only=True)
    ckpt["model"] = ours.state_dict()
    torch.save(ckpt, init)
    assert export(monkeypatch, "--export_hf", tmp_path / "hf", "--init_from", init) == 0
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.eos_token_id == hf.generation_config.eos_token_id == newline
    assert hf.generation_config.pad_token_id == newline
    prompt = torch.tensor([[CHARS.index(c) for c in "ROMEO:"]])
    new_tokens = 20
    expected, mask = gpt.generate(ours, prompt, new_tokens, temperature=0.0, eos_id=newline)
    out = hf.generate(prompt, max_new_tokens=new_tokens, do_sample=False)[0, prompt.size(1) :].tolist()
    assert out == expected[0, mask[0] > 0].tolist() == [newline]  # without an eos_token_id: 20 newlines


def test_the_readme_generate_line_runs_on_an_exported_default_char_model(tmp_path, monkeypatch):
    """README's transformers example, exactly as written there, on the export of a char model of gpt.py's default
    block_size: it samples past the newline (eos_token_id=None) and fits the model's positions."""
    import re
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    call = re.search(r"`(model\.generate\(\*\*tok\(.*?\))`", readme).group(1)
    init = char_checkpoint(tmp_path / "ckpt.pt", CHARS, block_size=gpt.Config.block_size, seed=3)
    assert export(monkeypatch, "--export_hf", tmp_path / "hf", "--init_from", init) == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.manual_seed(0)
    out = eval(call, {"model": model, "tok": tok})  # the README's own line
    new = int(re.search(r"max_new_tokens=(\d+)", call).group(1))
    assert out.shape == (1, len("ROMEO:") + new)  # no stop at a newline
