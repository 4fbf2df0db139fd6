"""A tiny random Llama with a byte-level BPE tokenizer, think and tool-call tokens, and an
R1-style chat template: enough for vLLM to serve real responses on a CPU.

python make_model.py OUT [HIDDEN LAYERS]: 128 and 2 by default (fast); 640 and 12 make about
79M parameters, slow enough on a CPU that a few tokens take tens of milliseconds.
"""

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out = Path(sys.argv[1])
hidden, layers = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (128, 2)
out.mkdir(parents=True, exist_ok=True)
special = ["<s>", "</s>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
text = [
    "What is the weather in Paris? Count slowly. What is 19+23? Answer with the number only. "
    'Think first. The quick brown fox jumps over the lazy dog. 0123456789 {}[]":,'
] * 50
trainer = trainers.BpeTrainer(
    vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
)
tok.train_from_iterator(text, trainer)
template = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}Assistant: {{ m['content'] }}\n"
    "{% elif m['role'] == 'tool' %}Tool: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
    "{% if add_generation_prompt %}Assistant: {% if thinking %}<think>\n{% endif %}{% endif %}"
)
fast = PreTrainedTokenizerFast(
    tokenizer_object=tok, bos_token="<s>", eos_token="</s>", chat_template=template
)
fast.save_pretrained(out)
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=len(fast),
    hidden_size=hidden,
    intermediate_size=hidden * 2 if hidden == 128 else hidden * 4,
    num_hidden_layers=layers,
    num_attention_heads=hidden // 64,
    num_key_value_heads=hidden // 64,
    max_position_embeddings=4096,
    bos_token_id=fast.bos_token_id,
    eos_token_id=fast.eos_token_id,
    torch_dtype="float32",
)
model = LlamaForCausalLM(config)
model.save_pretrained(out, safe_serialization=True)
print(
    "vocab",
    len(fast),
    "params",
    model.num_parameters(),
    "files",
    sorted(p.name for p in out.iterdir()),
)
