"""Model and tokenizer loading for the command line: a local checkpoint, or one of two built-in models.
Both are transformers' DeepSeek-V2 with the committed offline 1024-token tokenizer (assets/builtin_tokenizer):

- `builtin_model()`, the chat model `mla-ops ask` answers with: 3.4M parameters (hidden 256, 4 layers,
  4 heads; MLA with kv_lora_rank 64, rope 16, nope 32, v 32) trained on questions and answers built from
  Python's standard-library docstrings (tools/train_builtin_model.py, docs/builtin-model.md), committed in
  assets/builtin_model. Its answers read as English about Python and are often wrong.
- `lite_dims_model()`, the model the benchmarks time: V2-Lite's attention dimensions (hidden 2048,
  16 heads, kv_lora_rank 512, rope 64, nope 128, v 128, YaRN), 2 layers (one dense, one MoE with 8 small
  experts) and seeded random weights. Its timings, memory and op paths are real; its text is noise.

A checkpoint that ships its own code (config.json `auto_map`, DeepSeek-V2-Lite's modeling_deepseek.py)
runs that code with --trust-remote-code. The hub DeepSeek-V2 code is written for transformers 4.x (tested
on 4.45; 4.54 dropped the Cache.get_usable_length it calls), where transformers has no DeepSeek-V2 of its
own and from_pretrained takes `torch_dtype` rather than `dtype`.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import pickle
from typing import Callable, Optional

import torch

from .._optional import has_module
from .runtime import CliError, first_line, resolve_dtype

BUILTIN_TOKENIZER = pathlib.Path(__file__).resolve().parents[1] / "assets" / "builtin_tokenizer"
BUILTIN_MODEL = pathlib.Path(__file__).resolve().parents[1] / "assets" / "builtin_model"
BUILTIN_MODEL_DESCRIPTION = ("built-in model: a 3.4M-parameter DeepSeek-V2-architecture (MLA) model trained on "
                             "Python's docstrings; its answers are short and often wrong; pass --model-path for a "
                             "real checkpoint")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
DEEPSEEK_V2_TYPES = ("deepseek_v2",)  # the native model's and the hub remote code's config


@dataclasses.dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    source: str  # "built-in" (the chat model), "built-in timing" or the checkpoint directory
    dtype: torch.dtype
    notes: list[str]


def runs_remote_code(model_path: Optional[str], trust_remote_code: bool) -> bool:
    """Whether loading `model_path` runs the checkpoint's own modeling code: --trust-remote-code and an
    `auto_map` in its config.json. An unreadable config.json is left to inspect_checkpoint's errors."""
    if not (model_path and trust_remote_code):
        return False
    try:
        config = json.loads((pathlib.Path(model_path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("auto_map"))


def _require_native_deepseek_v2(what: str, fix: str) -> None:
    """transformers' own DeepSeek-V2 arrived in 4.54: before that only a checkpoint's remote code runs it."""
    if not has_module("transformers.models.deepseek_v2"):
        import transformers

        raise CliError(f"{what} needs transformers' native DeepSeek-V2, which transformers {transformers.__version__} "
                       f"lacks (it came in 4.54); {fix}")


def builtin_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(BUILTIN_TOKENIZER, local_files_only=True)


def builtin_model(dtype: torch.dtype, device: torch.device, *, attn: str = "sdpa"):
    """The built-in chat model (trained weights from assets/builtin_model, in `dtype` on `device`, eval
    mode) and the built-in tokenizer."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from ..models import build_model

    tokenizer = builtin_tokenizer()
    config = AutoConfig.from_pretrained(BUILTIN_MODEL, local_files_only=True)
    model = build_model(config, dtype, attn)
    model.load_state_dict(load_file(BUILTIN_MODEL / "model.safetensors"), strict=True)  # every tensor, no other
    model = model.to(device)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def lite_dims_model(dtype: torch.dtype, device: torch.device, *, attn: str = "sdpa", seed: int = 0,
                    layers: int = 2):
    """The timing model: DeepSeek-V2 with V2-Lite's attention dims and seeded random weights, sized to
    the built-in tokenizer."""
    from ..models import build_model, lite_attn_config

    tokenizer = builtin_tokenizer()
    config = lite_attn_config(vocab_size=len(tokenizer), num_hidden_layers=layers,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    model = build_model(config, dtype, attn, seed=seed).to(device)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def is_supported_model_type(model_type) -> bool:
    """Whether `ask --model-path` runs a checkpoint of `model_type` (imports that family's module only): a
    family the patch supports whose checkpoints `AutoModelForCausalLM` loads (a multimodal wrapper such as
    kimi_k25 has no causal-LM mapping)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ..integrations.transformers import families, shared_kv

    if model_type in DEEPSEEK_V2_TYPES:
        return True
    installed = families.installed_mla_model_types() + shared_kv.installed_shared_kv_model_types()
    if not isinstance(model_type, str) or model_type not in installed:
        return False
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return False
    try:
        return all(f.refused is None for f in families.families_of(model_type))
    except Exception:  # a modeling module that does not import here (a missing optional package)
        return False


def supported_model_types() -> tuple[str, ...]:
    """model_type values `ask --model-path` runs: DeepSeek-V2 (native or hub remote code) and every MLA
    family of the installed transformers that the patch supports (read off the classes)."""
    from ..integrations.transformers import families, shared_kv

    installed = families.installed_mla_model_types() + shared_kv.installed_shared_kv_model_types()
    found = [t for t in installed if is_supported_model_type(t)]
    return tuple(dict.fromkeys(DEEPSEEK_V2_TYPES + tuple(found)))


def inspect_checkpoint(path: pathlib.Path, *, allow_pickle: bool) -> dict:
    """Check a local checkpoint directory before touching transformers; clear errors for what is missing."""
    if not path.exists():
        raise CliError(f"--model-path {path}: no such directory")
    if not path.is_dir():
        raise CliError(f"--model-path {path}: not a directory (expected config.json, *.safetensors, tokenizer files)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CliError(f"--model-path {path}: config.json is missing; is this a transformers checkpoint directory?")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CliError(f"--model-path {path}: config.json is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CliError(f"--model-path {path}: config.json must be a JSON object (a model config), got a JSON "
                       f"{type(config).__name__}; use the checkpoint's own config.json")
    model_type = config.get("model_type")
    if not is_supported_model_type(model_type):
        supported = supported_model_types()
        raise CliError(f"--model-path {path}: config.json says model_type {model_type!r}, but mla-ops ask runs "
                       f"multi-head latent attention checkpoints the patch supports (model_type one of "
                       f"{', '.join(supported)}); point --model-path at one")
    safetensors = sorted(path.glob("*.safetensors"))
    pickles = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if not safetensors and pickles and not allow_pickle:
        raise CliError(
            f"--model-path {path}: the weights are pickle files ({', '.join(p.name for p in pickles[:3])}); "
            f"loading pickle can run arbitrary code, so mla-ops only loads safetensors. Convert the checkpoint "
            f"to safetensors, or pass --allow-pickle if you trust its source.")
    if not safetensors and not pickles:
        raise CliError(f"--model-path {path}: no weights found (*.safetensors)")
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        raise CliError(f"--model-path {path}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    for file in safetensors:
        _check_safetensors(path, file)
    return {"config": config, "safetensors": bool(safetensors)}


def _check_safetensors(path: pathlib.Path, file: pathlib.Path) -> None:
    """Read a safetensors file's header (its tensor table, no data): a truncated or garbage file is
    named here rather than failing deep inside transformers."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # opening checks the header's offsets against the file size
                handle.get_slice(key)
    except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ...
        raise CliError(f"--model-path {path}: {file.name} is not a readable safetensors file ({first_line(exc)}); "
                       f"re-download or re-save the checkpoint") from None


def _checkpoint_dtype(config: dict) -> Optional[torch.dtype]:
    name = config.get("torch_dtype") or config.get("dtype")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(name)


def _dtype_keyword() -> str:
    """from_pretrained's dtype argument: `dtype` since transformers 4.56, `torch_dtype` before (where
    an unknown `dtype` would reach the model's __init__)."""
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def _supports_sdpa(model_type) -> bool:
    """Whether transformers' causal LM of `model_type` runs SDPA attention (DeepSeek-V4 runs eager only)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) if isinstance(model_type, str) else None
    model_class = getattr(transformers, name, None) if name else None
    return bool(getattr(model_class, "_supports_sdpa", True))


def checkpoint_model(path: pathlib.Path, dtype_name: str, device: torch.device, *, trust_remote_code: bool,
                     allow_pickle: bool, attn: str = "sdpa", progress: Callable[[str], None] = print):
    """Load a local checkpoint offline: native DeepseekV2ForCausalLM unless --trust-remote-code."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = inspect_checkpoint(path, allow_pickle=allow_pickle)
    config = info["config"]
    notes = []
    remote_code = bool(config.get("auto_map")) and trust_remote_code
    if not remote_code:
        _require_native_deepseek_v2(
            f"--model-path {path}", "pass --trust-remote-code to run the checkpoint's own modeling_deepseek.py"
            if config.get("auto_map") else "install transformers 5.x, or use a checkpoint that ships its code")
    if config.get("auto_map") and not trust_remote_code:
        notes.append("the checkpoint ships remote code (auto_map); loading it with transformers' native "
                     "DeepSeek-V2 (pass --trust-remote-code to run its modeling_deepseek.py instead)")
    dtype = resolve_dtype(dtype_name, device, _checkpoint_dtype(config))
    progress(f"loading tokenizer from {path}")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    progress(f"loading weights from {path} ({'safetensors' if info['safetensors'] else 'pickle'}, {dtype})")
    kwargs = {_dtype_keyword(): dtype}
    # DeepSeek-V2's hub code has eager and FlashAttention-2 attention only, and asking transformers for
    # SDPA on a model without it is an error: for remote code, "sdpa" is left to transformers, which
    # picks SDPA where the code has it and its eager attention otherwise.
    if not remote_code and attn == "sdpa" and not _supports_sdpa(config.get("model_type")):
        notes.append(f"--attn sdpa: transformers has no SDPA attention for {config.get('model_type')} models "
                     f"(DeepSeek-V4's attention sinks are outside what SDPA computes); running their eager attention")
        attn = "eager"
    if not (remote_code and attn == "sdpa"):
        kwargs["attn_implementation"] = attn
    try:
        # mismatched shapes are collected (and refused below, by name) rather than raised
        model, loading_info = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code, use_safetensors=info["safetensors"],
            output_loading_info=True, ignore_mismatched_sizes=True, **kwargs)
    except pickle.UnpicklingError:
        raise CliError(f"--model-path {path}: the pickle weights hold objects other than tensors, which the safe "
                       f"loader (torch.load(weights_only=True)) refuses even with --allow-pickle; convert the "
                       f"checkpoint to safetensors") from None
    except Exception as exc:  # a broken config, an unreadable file, ...
        raise CliError(f"--model-path {path}: transformers could not load the checkpoint ({first_line(exc)[:300]}); "
                       f"check that the weights match config.json") from None
    mismatched = loading_info.get("mismatched_keys") or ()
    if mismatched:
        shown = "; ".join(f"{e[0]}: checkpoint {list(e[1])} vs model {list(e[2])}"
                          if isinstance(e, (tuple, list)) and len(e) == 3 else str(e) for e in list(mismatched)[:3])
        raise CliError(f"--model-path {path}: {len(mismatched)} weight(s) have shapes that do not match config.json "
                       f"({shown}); use the config.json saved with these weights")
    missing = sorted(loading_info.get("missing_keys") or ())
    if missing:  # transformers would fill them with random values and only log a warning
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise CliError(f"--model-path {path}: the checkpoint lacks {len(missing)} weight(s) the model needs "
                       f"({shown}); they would be random. Use a complete checkpoint")
    used = getattr(model.config, "_attn_implementation", attn)
    if used != attn:
        notes.append(f"--attn {attn}: the checkpoint's remote code has no {attn} attention; running its {used} "
                     f"attention")
    model = model.to(device).eval()
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id
    return Loaded(model, tokenizer, str(path), dtype, notes)


def load(model_path: Optional[str], dtype_name: str, device: torch.device, *, trust_remote_code: bool = False,
         allow_pickle: bool = False, attn: str = "sdpa", builtin: str = "lite-dims",
         progress: Callable[[str], None] = print) -> Loaded:
    """`model_path`'s checkpoint, or without one the built-in model `builtin`: "chat" (`builtin_model`,
    what `mla-ops ask` answers with) or "lite-dims" (`lite_dims_model`, what the benchmarks time)."""
    if model_path:
        return checkpoint_model(pathlib.Path(model_path).expanduser(), dtype_name, device,
                                trust_remote_code=trust_remote_code, allow_pickle=allow_pickle, attn=attn,
                                progress=progress)
    if builtin not in ("chat", "lite-dims"):
        raise ValueError(f"builtin={builtin!r}: choose 'chat' or 'lite-dims'")
    _require_native_deepseek_v2("the built-in model (no --model-path / $MODEL_PATH)",
                                "install transformers 5.x, or give --model-path with --trust-remote-code for a "
                                "checkpoint that ships its modeling code")
    dtype = resolve_dtype(dtype_name, device)
    if builtin == "chat":
        progress("no --model-path / $MODEL_PATH: loading the built-in chat model")
        model, tokenizer = builtin_model(dtype, device, attn=attn)
        return Loaded(model, tokenizer, "built-in", dtype, [BUILTIN_MODEL_DESCRIPTION])
    progress("no --model-path / $MODEL_PATH: building the built-in timing model, a DeepSeek-V2 with V2-Lite "
             "attention dims (2 layers, small MoE, 1024-token vocab)")
    model, tokenizer = lite_dims_model(dtype, device, attn=attn)
    notes = ["the built-in timing model has seeded RANDOM weights: its text is noise; timings, memory and the op "
             "paths are real"]
    return Loaded(model, tokenizer, "built-in timing", dtype, notes)
