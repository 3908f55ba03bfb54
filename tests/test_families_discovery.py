"""Every transformers model that carries a multi-head latent attention is found, and is either served or
refused with what the ops cannot compute: the patch lists families from the installed package's files
(`families.installed_mla_model_types`), and this test walks the package itself to check that list.

What counts as a latent attention here (the criterion, independent of the patch's own recognition):

* a class: an `nn.Module` of any `transformers.models.*.modeling_*` module (every one that imports here)
  whose `__init__` reads the KV latent rank (`kv_lora_rank`) or builds a latent projection of MLA
  (`kv_a_proj_with_mqa`, `kv_b_proj`): the names of DeepSeek-V2's design that every transformers MLA family
  keeps, whatever else it renames; or DeepSeek-V4's shared-KV attention (`shared_kv.SHARED_KV_MODULES`);
* a model type: one whose configuration, or the text configuration its default configuration builds (a
  multimodal wrapper), has a `kv_lora_rank`: a model type without modeling of its own (Sarvam's `sarvam_mla`,
  DeepSeek-V3's model) or a wrapper around another family's language model (Kimi-K2.5) counts too.

A class found so must be one the patch recognises (`families.describe`) and then either supported, with a tiny
config in tests/mla_families.py (so the family tests run it), or refused with a reason naming the code it does
not reproduce (a name its forward, or its indexer's, uses beyond what the patch computes).
"""
import importlib
import importlib.util
import pathlib

import pytest
import torch

import mla_ops
from mla_ops.integrations.transformers import MLAPagedCache, families, shared_kv

import mla_families

pytestmark = pytest.mark.slow

LATENT_NAMES = {"kv_lora_rank", "kv_a_proj_with_mqa", "kv_b_proj"}
# supported families with tests of their own instead of a tiny config here
TESTED_APART = {"deepseek_v4": "tests/test_deepseek_v4.py"}


def _modeling_modules():
    """(module name, module or the ImportError text) of every modeling file of the installed transformers."""
    import transformers

    root = pathlib.Path(transformers.__file__).parent / "models"
    for path in sorted(root.glob("*/modeling_*.py")):
        name = f"transformers.models.{path.parent.name}.{path.stem}"
        try:
            yield name, importlib.import_module(name)
        except ImportError as exc:  # an optional package this machine lacks (its classes cannot run here either)
            yield name, f"{type(exc).__name__}: {exc}"


def _latent_attention_classes():
    """Every class of the installed transformers that meets the module docstring's criterion."""
    found, skipped = [], []
    for name, module in _modeling_modules():
        if isinstance(module, str):
            skipped.append((name, module))
            continue
        for obj in vars(module).values():
            if not (isinstance(obj, type) and obj.__module__ == name and issubclass(obj, torch.nn.Module)):
                continue
            init = getattr(obj.__dict__.get("__init__"), "__code__", None)
            if init is None:
                continue
            if LATENT_NAMES & set(init.co_names) or shared_kv.builds_shared_kv_modules(obj):
                found.append(obj)
    return found, skipped


def _latent_model_types():
    """Every model type whose configuration (or default text configuration) has a kv_lora_rank."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    def has_latent_rank(config_class) -> bool:  # (read off the class: some configs refuse global reads)
        return "kv_lora_rank" in set(getattr(config_class, "__dataclass_fields__", ())) | set(vars(config_class))

    found = []
    for model_type in CONFIG_MAPPING_NAMES:
        try:
            config_class = CONFIG_MAPPING[model_type]
        except ImportError:
            continue
        if has_latent_rank(config_class):
            found.append(model_type)
        elif config_class.sub_configs:
            try:
                text = config_class().get_text_config(decoder=True)
            except Exception:  # a composite config that does not build from its defaults: not a text wrapper
                continue
            if text is not None and has_latent_rank(type(text)):
                found.append(model_type)
    return found


def _unreproduced_names(cls) -> set:
    """The names cls's forward (and its indexer's) uses beyond DeepSeek-V3's forward vocabulary."""
    names = set(families.forward_names(cls))
    for indexer in families.indexer_classes(cls):
        names |= set(families.forward_names(indexer)) - families.INDEXER_NAMES
    return {n for n in names - families.BASE_FORWARD_NAMES if len(n) > 3}


def test_every_latent_attention_class_is_served_or_refused_with_what_the_ops_cannot_compute():
    classes, skipped = _latent_attention_classes()
    assert {"DeepseekV2Attention", "DeepseekV3Attention", "DeepseekV4Attention"} <= {c.__name__ for c in classes}
    installed = set(families.installed_mla_model_types()) | set(shared_kv.installed_shared_kv_model_types())
    problems = []
    for cls in classes:
        model_dir = cls.__module__.split(".")[2]
        if not (families.builds_mla_modules(cls) or shared_kv.builds_shared_kv_modules(cls)):
            problems.append(f"{cls.__module__}.{cls.__name__}: a latent attention the patch does not recognise")
            continue
        if model_dir not in installed:
            problems.append(f"{cls.__name__}: its model type {model_dir} is missing from the installed MLA families")
        described = families.describe(cls)
        if described.refused is None:
            if model_dir not in mla_families.FAMILIES and model_dir not in TESTED_APART:
                problems.append(f"{cls.__name__}: supported but untested (no tiny config in tests/mla_families.py)")
        elif not any(name in described.refused for name in _unreproduced_names(cls)):
            problems.append(f"{cls.__name__}: refused without naming the code it does not reproduce: "
                            f"{described.refused!r}")
    assert not problems, "\n".join(problems)
    # what does not import here is an optional package's model (an audio tokenizer), not an MLA one
    assert all("kv_a_proj_with_mqa" not in pathlib.Path(importlib.util.find_spec(n).origin).read_text()
               for n, _ in skipped), skipped


def test_every_model_type_with_a_latent_config_is_listed_and_tested():
    """The model types found by their configurations are listed by the patch, resolve to attention classes
    (their own modeling's, or the family's they are built from) and have a tiny config in the tests."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    installed = set(families.installed_mla_model_types())
    found = _latent_model_types()
    assert {"deepseek_v3", "sarvam_mla", "kimi_k25"} <= set(found)
    for model_type in found:
        # a family's own sub-model types (its text model) belong to the family listed under its directory
        listed = model_type if model_type in installed else model_type_to_module_name(model_type)
        assert listed in installed, model_type
        assert families.families_of(listed), model_type
        assert listed in mla_families.FAMILIES, model_type


def test_model_types_built_from_another_familys_classes():
    """sarvam_mla has a configuration only (its models are DeepSeek-V3's), kimi_k25 wraps a DeepSeek-V3 language
    model: both are found through the classes they build, and patched as those."""
    assert families.borrowed_model_types()["sarvam_mla"] == "deepseek_v3"
    assert families.borrowed_model_types()["kimi_k25"] == "deepseek_v3"
    for model_type in ("sarvam_mla", "kimi_k25"):
        (described,) = families.families_of(model_type)
        assert described.attention.__name__ == "DeepseekV3Attention" and described.refused is None


@pytest.mark.parametrize("family", ["kimi_k25", "mistral_large4"])
def test_class_level_paged_patch_of_a_multimodal_wrapper(family):
    """family=... patches the attention classes and the wrapper's generate (Kimi-K2.5: DeepSeek-V3's attention
    in a wrapper of its own; Mistral-Large-4: its own attention and wrapper), so every model of the family
    generates on an MLAPagedCache, with the stock model's tokens; revert restores both."""
    from test_families import _model

    model = _model(family)
    wrapper = type(model)
    ids = torch.randint(3, mla_families.VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    generate = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    stock_prepare = wrapper._prepare_cache_for_generation
    with torch.no_grad():
        expected = model.generate(ids, **generate)
        with mla_ops.patch(family=family):
            got = model.generate(ids, **generate)
    assert isinstance(got.past_key_values, MLAPagedCache)
    assert torch.equal(got.sequences, expected.sequences)
    assert wrapper._prepare_cache_for_generation is stock_prepare
