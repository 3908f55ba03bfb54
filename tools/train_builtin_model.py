"""Train mla_ops/assets/builtin_model/ (the built-in chat model of `mla-ops ask`).

A small DeepSeek-V2-architecture model (transformers' DeepseekV2ForCausalLM: multi-head latent attention
with a compressed KV latent, decoupled RoPE keys and separate value heads, so `mla-ops ask` runs it
through the same torch.ops.mla path as a real checkpoint) trained on questions and answers built from
the docstrings of Python's standard library, in DeepSeek-V2-Chat's format:

    User: What is the Python module json for?

    Assistant: JSON (JavaScript Object Notation) <https://json.org> is a subset of ...<eos>

The text is read with the same function that trains the built-in tokenizer
(tools/build_builtin_tokenizer.py `named_docstrings`); the answer is a docstring's first paragraph.
Training is seeded and runs on one CPU thread in fp32: 2000 steps, about 15 CPU-minutes on an AVX-512
CPU, final answer loss 0.014 (docs/builtin-model.md). The weights are saved in bf16 as safetensors. The
corpus follows the Python that runs this script (the committed weights were trained on CPython 3.11.7).
To retrain:

    .venv/bin/python tools/train_builtin_model.py            # writes mla_ops/assets/builtin_model/
    .venv/bin/python tools/train_builtin_model.py --steps 30 --out /tmp/m   # a quick timing run
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import pathlib
import random
import re
import time
import warnings

import torch
from build_builtin_tokenizer import named_docstrings

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "mla_ops" / "assets" / "builtin_model"
TOKENIZER = ROOT / "mla_ops" / "assets" / "builtin_tokenizer"
MAX_ANSWER_CHARS = 300  # longer first paragraphs are cut at a sentence end, or left out
MAX_TOKENS = 128  # one example: bos, question, answer, eos
SEED = 0


def model_config(tokenizer):
    """hidden 256, 4 dense layers, 4 heads; MLA with kv_lora_rank 64, rope 16, nope 32, v 32; no query LoRA."""
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=64, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=64, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)


def first_paragraph(doc: str, attr: str | None) -> str | None:
    """A docstring's first paragraph on one line, past a leading call signature ("S.split(sep) -> list"),
    cut to at most MAX_ANSWER_CHARS at a sentence end; None when there is no such paragraph."""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", doc.strip()) if p.strip()]
    while paragraphs and attr and ("->" in paragraphs[0] or paragraphs[0].split("(")[0].endswith(attr)):
        paragraphs.pop(0)
    if not paragraphs:
        return None
    text = paragraphs[0]
    if len(text) > MAX_ANSWER_CHARS:
        end = text.rfind(". ", 0, MAX_ANSWER_CHARS)
        if end < 40:
            return None
        text = text[:end + 1]
    return text if len(text) >= 12 else None


def question_answer_pairs() -> list[tuple[str, str]]:
    """(question, answer) for each standard-library module, public function and class (defined in that
    module) and public method of such a class, that has a usable docstring."""
    pairs = []
    for module, attr, obj, doc in named_docstrings():
        if attr is None:
            answer = first_paragraph(doc, None)
            if answer:
                pairs.append((f"What is the Python module {module} for?", answer))
            continue
        if attr.startswith("_") or getattr(obj, "__module__", None) != module:
            continue  # private, or imported from elsewhere (answered where it is defined)
        answer = first_paragraph(doc, attr)
        if isinstance(obj, type):
            if answer:
                pairs.append((f"What is the Python class {module}.{attr}?", answer))
            for name, method in sorted(vars(obj).items()):
                method_doc = getattr(method, "__doc__", None)
                if name.startswith("_") or not callable(method) or not isinstance(method_doc, str):
                    continue
                method_answer = first_paragraph(method_doc, name)
                if method_answer:
                    pairs.append((f"What does the Python method {module}.{attr}.{name} do?", method_answer))
        elif callable(obj) and answer:
            pairs.append((f"What does the Python function {module}.{attr} do?", answer))
    return list(dict(pairs).items())  # one answer per question


def encode(tokenizer, question: str, answer: str) -> tuple[list[int], int]:
    """Token ids of the chat-formatted pair (truncated to MAX_TOKENS, ending in eos when it fits) and how
    many of them are the prompt (bos, the question and 'Assistant:'), which carry no loss."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    answer_ids = tokenizer(" " + answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    return (prompt_ids + answer_ids)[:MAX_TOKENS], len(prompt_ids)


def batches(examples, batch_size: int, rng: random.Random, pad_id: int):
    """One epoch of padded batches in a seeded order: input ids [B, T] int64 and labels [B, T] int64
    (-100 on the prompt and the padding). Examples of similar length share a batch (sorted within
    windows of 16 batches), which keeps the padding, and so the time per epoch, small."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    window = batch_size * 16
    order = [i for w in range(0, len(order), window)
             for i in sorted(order[w:w + window], key=lambda i: len(examples[i][0]))]
    starts = list(range(0, len(order) - batch_size + 1, batch_size))
    rng.shuffle(starts)
    for start in starts:
        chunk = [examples[i] for i in order[start:start + batch_size]]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.full((batch_size, width), pad_id, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        for row, (ids, prompt_len) in enumerate(chunk):
            input_ids[row, :len(ids)] = torch.tensor(ids)
            labels[row, prompt_len:len(ids)] = torch.tensor(ids[prompt_len:])
        yield input_ids, labels


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps (default: 2000)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine decay, 200 warm-up steps)")
    parser.add_argument("--out", default=str(OUT), help=f"output directory (default: {OUT.relative_to(ROOT)})")
    args = parser.parse_args()

    from transformers import AutoTokenizer, DeepseekV2ForCausalLM

    torch.set_num_threads(1)  # deterministic and leaves the other cores to other work
    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER, local_files_only=True)
    # importing every standard-library module prints (`this`) and warns (deprecated modules)
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pairs = question_answer_pairs()
    examples = [encode(tokenizer, q, a) for q, a in pairs]
    tokens = sum(len(ids) - p for ids, p in examples)
    print(f"{len(pairs)} question/answer pairs, {tokens} answer tokens per epoch", flush=True)

    config = model_config(tokenizer)
    config._attn_implementation = "sdpa"
    model = DeepseekV2ForCausalLM(config).float().train()
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.2f}M parameters", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = min(200, args.steps // 10)

    def learning_rate(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(args.steps - warmup, 1)))

    rng = random.Random(SEED)
    step, epoch, start, cpu_start, window = 0, 0, time.time(), time.process_time(), []
    while step < args.steps:
        epoch += 1
        for input_ids, labels in batches(examples, args.batch_size, rng, tokenizer.pad_token_id):
            if step >= args.steps:
                break
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step)
            loss = model(input_ids=input_ids, attention_mask=(input_ids != tokenizer.pad_token_id).long(),
                         labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            window.append(loss.item())
            if step % 100 == 0 or step == args.steps:
                print(f"step {step:>5}  epoch {epoch:>3}  answer loss {sum(window) / len(window):.3f}  "
                      f"{time.time() - start:.0f} s ({time.process_time() - cpu_start:.0f} CPU-s)", flush=True)
                window = []
    print(f"trained {step} steps ({epoch} epochs) in {time.time() - start:.0f} s "
          f"({time.process_time() - cpu_start:.0f} CPU-s)", flush=True)

    out = pathlib.Path(args.out)
    model = model.eval().to(torch.bfloat16)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    print(f"wrote {out} ({(out / 'model.safetensors').stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
