"""Pretrained folders given by `[model] path`: checked before launch, loaded whole, trained from step 0."""

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from prl.model.pretrained import PretrainedError, check_pretrained, link_pretrained, load_pretrained


def make_pretrained(out: Path, arch: str = "qwen3_moe", seed: int = 123, shard: str = "150KB") -> Path:
    """A tiny model saved as a Hugging Face folder in several safetensors shards, with weights no
    seeded random init reproduces (so a test cannot pass by building the model from config)."""
    from prl.model.build import build_model
    from prl.model.tiny import char_tokenizer, write_model_dir
    from prl.recipe.schema import ModelCfg

    cfg_dir = write_model_dir(ModelCfg(arch=arch), out.with_name(out.name + "-config"))
    model = build_model(cfg_dir, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(out, max_shard_size=shard)
    char_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    return make_pretrained(tmp_path_factory.mktemp("hf") / "qwen3-tiny")


def token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids[None]).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]


def test_folder_is_sharded_and_checked(pretrained):
    info = check_pretrained(pretrained)
    assert len(info.files) > 1, "the fixture must exercise the sharded index"
    assert info.model_type == "qwen3_moe" and info.tensors > 10


def test_run_folder_links_weights_and_loads_exactly(pretrained, tmp_path):
    """The run's model folder (copied config + tokenizer, linked shards) loads to the same logprobs
    as from_pretrained on the user's folder."""
    from transformers import AutoModelForCausalLM

    from prl.model.build import build_model

    run_model = link_pretrained(pretrained, tmp_path / "model")
    assert all((run_model / f.name).is_symlink() for f in check_pretrained(pretrained).files)
    ours = build_model(run_model, seed=0).eval()
    ref = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32).eval()
    ids = torch.tensor([1, 5, 9, 22, 7, 30, 4, 2])
    with torch.no_grad():
        assert torch.equal(token_logprobs(ours, ids), token_logprobs(ref, ids))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_broken_folders_are_refused_by_name(pretrained, tmp_path):
    index = json.loads((pretrained / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]

    missing = _copy(pretrained, tmp_path / "missing")
    (missing / shard).unlink()
    with pytest.raises(PretrainedError, match="missing"):
        check_pretrained(missing)

    truncated = _copy(pretrained, tmp_path / "truncated")
    data = (truncated / shard).read_bytes()
    (truncated / shard).write_bytes(data[: len(data) // 2])
    with pytest.raises(PretrainedError, match=f"{shard}: truncated"):
        check_pretrained(truncated)

    garbage = _copy(pretrained, tmp_path / "garbage")
    (garbage / shard).write_bytes(struct.pack("<Q", 12) + b"not json at all")
    with pytest.raises(PretrainedError, match=shard):
        check_pretrained(garbage)

    entries = _copy(pretrained, tmp_path / "entries")
    header = b'{"a": 1}'
    (entries / shard).write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(PretrainedError, match=f"{shard}: not a safetensors file"):
        check_pretrained(entries)

    no_weights = tmp_path / "bin-only"
    no_weights.mkdir()
    shutil.copy(pretrained / "config.json", no_weights)
    shutil.copy(pretrained / "tokenizer.json", no_weights)
    (no_weights / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(PretrainedError, match="safetensors"):
        check_pretrained(no_weights)

    with pytest.raises(PretrainedError, match="not a folder"):
        check_pretrained(tmp_path / "nowhere")


def test_a_missing_tensor_is_an_error_not_a_random_init(pretrained, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = _copy(pretrained, tmp_path / "dropped")
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.layers.1.self_attn.o_proj.weight"
    shard = broken / index["weight_map"].pop(name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    with pytest.raises(PretrainedError, match="o_proj"):
        load_pretrained(broken, torch.float32)


def test_warm_start_is_off_by_default_for_a_pretrained_model():
    from prl.recipe.schema import ModelCfg, SftCfg

    assert SftCfg().steps_for(ModelCfg(path="/some/folder")) == 0
    assert SftCfg().steps_for(ModelCfg()) == 40
    assert SftCfg(steps=5).steps_for(ModelCfg(path="/some/folder")) == 5


def test_a_tiny_model_folder_is_written_once_then_copied_from_the_cache(tmp_path, monkeypatch):
    """transformers' config classes take seconds to import, so the files of a model section are kept
    (keyed by the section, prl's code and the library versions) and copied: the same bytes."""
    from prl.model.tiny import cache_dir, write_model_dir
    from prl.recipe.schema import Recipe

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = Recipe.model_validate({}).model
    assert not cache_dir(model).exists()
    first = write_model_dir(model, tmp_path / "a")
    assert cache_dir(model).is_dir()
    second = write_model_dir(model, tmp_path / "b")
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir()) and "config.json" in names
    assert all((first / n).read_bytes() == (second / n).read_bytes() for n in names)
    other = Recipe.model_validate({"model": {"num_layers": 2}}).model
    assert cache_dir(other) != cache_dir(model)  # another section, another entry


def test_a_generic_tokenizer_loads_as_auto_tokenizer_loads_it(tmp_path):
    """A folder of prl's tiny families (or a tokenizer alone) whose tokenizer is transformers' generic fast one loads
    without AutoTokenizer, as the same tokenizer (class, ids, specials, chat template, decoding); another class, code
    of the folder's own, or a model type for which AutoTokenizer picks a class of its own goes through AutoTokenizer."""
    from transformers import AutoTokenizer

    from prl.model.build import generic_tokenizer, load_tokenizer
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg
    from test_envs import chat_tokenizer

    chat_tokenizer().save_pretrained(tmp_path / "chat")
    folders = [tmp_path / "chat", *(write_model_dir(ModelCfg(arch=a), tmp_path / a) for a in ("glm_moe_dsa", "qwen3_moe"))]
    convo = [{"role": "user", "content": "rev: abc"}, {"role": "assistant", "content": "cba"}]
    for folder in folders:
        assert generic_tokenizer(folder), folder
        ours, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
        assert type(ours) is type(auto) and ours.chat_template == auto.chat_template
        assert (ours.eos_token_id, ours.all_special_ids, len(ours)) == (auto.eos_token_id, auto.all_special_ids, len(auto))
        for text in ("abc def", "<|im_start|>x<|im_end|>", "\n?!"):
            assert ours(text).input_ids == auto(text).input_ids
        if ours.chat_template:
            assert ours.apply_chat_template(convo, add_generation_prompt=True) == \
                auto.apply_chat_template(convo, add_generation_prompt=True)
        assert ours.decode(auto("abc def").input_ids) == auto.decode(auto("abc def").input_ids)
    folder = folders[1]
    tokenizer, config = (json.loads((folder / f).read_text()) for f in ("tokenizer_config.json", "config.json"))
    for name, change in (("tokenizer_config.json", {"tokenizer_class": "Qwen2Tokenizer"}),
                         ("tokenizer_config.json", {"auto_map": {"AutoTokenizer": ["x.T", None]}}),
                         ("config.json", {"model_type": "qwen2"})):  # AutoTokenizer: Qwen2Tokenizer, whatever it names
        original = tokenizer if name == "tokenizer_config.json" else config
        (folder / name).write_text(json.dumps({**original, **change}))
        assert not generic_tokenizer(folder), change
        (folder / name).write_text(json.dumps(original))
    assert generic_tokenizer(folder)
    (folder / "tokenizer.json").unlink()
    assert not generic_tokenizer(folder) and not generic_tokenizer(tmp_path / "missing")
