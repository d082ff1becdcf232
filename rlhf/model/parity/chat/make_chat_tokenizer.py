"""Train the tiny byte-level BPE tokenizer used by the chat-template parity fixtures.

Writes rlhf/model/parity/chat/tokenizer.json: GPT-2/Qwen style (no normalizer, ByteLevel
pre-tokenizer without prefix space, ByteLevel post-processor and decoder), trained on
rlhf/model/assets/corpus.txt, with the chat special tokens at ids 0..8.

Deterministic: the same corpus and `tokenizers` version give a byte-identical file.

    ~/.cache/rtrun/parity-venv/bin/python rlhf/model/parity/chat/make_chat_tokenizer.py
"""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[3]
CORPUS = REPO / "rlhf" / "model" / "assets" / "corpus.txt"
OUT = HERE / "tokenizer.json"

VOCAB_SIZE = 600
# Id order matters: the Rust test and the tokenizer_config files refer to these ids.
SPECIAL_TOKENS = [
    "<|pad|>",  # 0
    "<|endoftext|>",  # 1
    "<|im_start|>",  # 2
    "<|im_end|>",  # 3
    "<|begin_of_text|>",  # 4
    "<|end_of_text|>",  # 5
    "<|start_header_id|>",  # 6
    "<|end_header_id|>",  # 7
    "<|eot_id|>",  # 8
]


def main() -> None:
    tok = Tokenizer(models.BPE())
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=True)
    tok.decoder = decoders.ByteLevel()  # decoding ignores add_prefix_space
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer=trainer)

    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    # Every byte must be encodable (unicode content falls back to byte tokens).
    sample = "héllo 中文 🙂\n\t  x"
    assert tok.decode(tok.encode(sample).ids) == sample

    tok.save(str(OUT), pretty=True)
    print(f"wrote {OUT.relative_to(REPO)}: vocab {tok.get_vocab_size()} (with added tokens)")


if __name__ == "__main__":
    main()
