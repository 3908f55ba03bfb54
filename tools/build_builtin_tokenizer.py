"""Rebuild mla_ops/assets/builtin_tokenizer/ (the offline tokenizer of the built-in demo model).

A 1024-token byte-level BPE trained with `tokenizers` on the docstrings of Python's standard
library (English prose and code, always on the machine), plus DeepSeek-style special tokens and a
chat template in DeepSeek-V2-Chat's format. The result is committed, so the demo does not depend
on the Python version it runs on; rerun this only to change the tokenizer:

    .venv/bin/python tools/build_builtin_tokenizer.py
"""
import importlib
import pathlib
import pkgutil
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

OUT = pathlib.Path(__file__).resolve().parents[1] / "mla_ops" / "assets" / "builtin_tokenizer"
SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜pad｜>"]
# DeepSeek-V2-Lite-Chat's template: bos, then "User: ...\n\nAssistant: ...<eos>" turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ 'User: ' + message['content'] + '\n\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}"
    "{{ message['content'] + '\n\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ 'Assistant:' }}{% endif %}"
)


def named_docstrings():
    """(module name, attribute name or None for the module's own docstring, object, docstring) for every
    public standard-library module on sys.path that imports here, modules and attributes in sorted order."""
    names = sorted(m.name for m in pkgutil.iter_modules() if m.name in sys.stdlib_module_names
                   and not m.name.startswith("_"))
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception:
            continue
        if module.__doc__:
            yield name, None, module, module.__doc__
        for attr in sorted(vars(module)):
            obj = getattr(module, attr, None)
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str):
                yield name, attr, obj, doc


def corpus():
    """The tokenizer's training text: every docstring of named_docstrings()."""
    for *_, doc in named_docstrings():
        yield doc


def main():
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=SPECIAL[0], eos_token=SPECIAL[1],
                                   pad_token=SPECIAL[2])
    fast.chat_template = CHAT_TEMPLATE
    OUT.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(OUT)
    print(f"wrote {OUT} ({len(fast)} tokens)")


if __name__ == "__main__":
    main()
