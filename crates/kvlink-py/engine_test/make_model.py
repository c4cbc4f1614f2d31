"""Tiny Llama checkpoints and a tokenizer, made here: no hub, no download.

``make(dir, seed)`` writes a Hugging Face model directory that ``vllm serve``
loads offline: ``config.json`` (4 layers, hidden 256, 4 attention heads,
2 KV heads, fp32, 4,096 positions), ``model.safetensors`` (random weights
from ``seed``) and a word-level tokenizer (``tokenizer.json`` wrapped as a
``PreTrainedTokenizerFast``). Two seeds give two checkpoints with the same
shapes and tokenizer but other weights: P serving one and D the other
proves D decodes from P's KV.

Run as a script: ``python make_model.py DIR SEED [DIR SEED ...]`` (one
process for all, so torch and transformers are imported once).
"""

from __future__ import annotations

import json
import os
import sys

#: The words of the tokenizer: short made-up ones, so any token id sequence
#: detokenizes to plain text.
NUM_WORDS = 2000
SPECIAL = ["<unk>", "<s>", "</s>"]

#: The model's shape (also what the test reads back: block and cache sizes).
CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

#: Weights are drawn wider than transformers' 0.02 default, which leaves a
#: random model's logits so close together (top two within 5e-4 somewhere
#: in 128 greedy steps) that a last-bit difference between two engines'
#: kernels could flip a choice; at 0.25 the closest pair seen was 1e-2 apart.
#: Either way the next token depends on the whole context: decoding over
#: the other checkpoint's KV changed every one of 8 continuations.
INIT_STD = 0.25

#: A chat template, only so that vLLM's start-up warm-up of the chat
#: endpoint finds one (the test uses completions).
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


def vocab() -> dict[str, int]:
    words = SPECIAL + [f"w{i}" for i in range(NUM_WORDS)]
    return {word: index for index, word in enumerate(words)}


def write_tokenizer(directory: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=CONFIG["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def write_model(directory: str, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(SPECIAL) + NUM_WORDS,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=INIT_STD,
        torch_dtype="float32",
        **CONFIG,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(directory, safe_serialization=True)


def make(directory: str, seed: int) -> str:
    """Writes checkpoint ``seed`` into ``directory`` (created); returns it."""
    os.makedirs(directory, exist_ok=True)
    write_tokenizer(directory)
    write_model(directory, seed)
    with open(os.path.join(directory, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == CONFIG["num_hidden_layers"]
    return directory


if __name__ == "__main__":
    pairs = sys.argv[1:]
    if not pairs or len(pairs) % 2:
        sys.exit("usage: make_model.py DIR SEED [DIR SEED ...]")
    for directory, seed in zip(pairs[::2], pairs[1::2]):
        make(directory, int(seed))
