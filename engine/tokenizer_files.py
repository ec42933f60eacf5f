"""The text side of a checkpoint that ``make_checkpoint`` writes: a byte-level BPE tokenizer trained with
``tokenizers`` on the docstrings of kvtier's own modules (text the project ships; the same source gives the same
tokenizer), ``tokenizer_config.json`` with a ChatML chat template, and ``generation_config.json`` naming the
end-of-sequence tokens, in the files and shapes Hugging Face writes them.

Ids 0–4 are the special tokens ``<|pad|> <|bos|> <|eos|> <|im_start|> <|im_end|>``; a vocabulary larger than
the merges the corpus supports is filled with ``<|reserved_N|>`` special tokens (as Llama 3 reserves its), so
the tokenizer's size always equals the model's ``vocab_size``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
from pathlib import Path

SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID, END_OF_TURN_ID = 1, 2, 4
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS_PACKAGES = (
    "kvtier.kvstore",
    "kvtier.kvstore.wire",
    "kvtier.kvstore.cluster",
    "kvtier.kvstore.node",
    "kvtier.kvstore.client",
    "kvtier.gc",
    "kvtier.transfer",
    "kvtier.engine",
)


def corpus() -> list[str]:
    """Every docstring of the modules of :data:`CORPUS_PACKAGES`, in file order."""
    texts = []
    for package in CORPUS_PACKAGES:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, package
        for path in sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.py")):
            for node in ast.walk(_parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    doc = ast.get_docstring(node)
                    if doc:
                        texts.append(doc)
    return texts


def _parse(source: str, attempts: int = 3) -> ast.Module:
    """``ast.parse``, again on CPython 3.11's spurious ``SystemError`` ("AST constructor recursion depth
    mismatch"): its AST conversion keeps one depth counter per interpreter, so a traceback formatted on another
    thread at that moment (3.11's tracebacks parse the failing line) upsets it; the source itself is fine."""
    for _ in range(attempts - 1):
        with contextlib.suppress(SystemError):
            return ast.parse(source)
    return ast.parse(source)


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """Train and write ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json`` into ``out``
    for a model of ``vocab_size`` tokens (at least 261: the specials and the 256 bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < len(SPECIAL) + 256:
        raise ValueError(f"a byte-level tokenizer needs a vocabulary of at least {len(SPECIAL) + 256} tokens")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    short = vocab_size - tokenizer.get_vocab_size()
    if short > 0:
        tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(short)])
    assert tokenizer.get_vocab_size() == vocab_size
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL[BOS_ID],
        "eos_token": SPECIAL[END_OF_TURN_ID],
        "pad_token": SPECIAL[0],
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, END_OF_TURN_ID]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
