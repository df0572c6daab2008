"""Train GPT-Neo language models with the stock Hugging Face Trainer, the way Wu & Papyan's study did.

Each model is an ordinary Trainer output folder (checkpoint-N/ subfolders, trainer_state.json with
eval losses, the final model at its root), so ``ncanalyze extract`` runs on it unchanged.
"""
from __future__ import annotations

import os
from itertools import chain
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def train_tokenizer(files: list[str | Path], vocab_size: int, out_dir: str | Path):
    """A byte-level BPE tokenizer (GPT-2 style) trained with ``tokenizers`` on local text files."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train([str(f) for f in files], vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<|endoftext|>",
                                  eos_token="<|endoftext|>", unk_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    tok.save_pretrained(str(out_dir))
    return tok


def lm_datasets(train_files, val_files, tokenizer, block_size: int, text_column: str = "text"):
    """Tokenize text files and cut them into ``block_size`` blocks (``run_clm``'s ``group_texts``)."""
    from datasets import load_dataset

    raw = load_dataset("text", data_files={"train": [str(f) for f in train_files],
                                           "validation": [str(f) for f in val_files]})

    def tokenize(batch):
        return tokenizer(batch[text_column])

    def group_texts(batch):
        joined = {k: list(chain(*batch[k])) for k in batch}
        n = len(joined["input_ids"]) // block_size * block_size
        out = {k: [v[i:i + block_size] for i in range(0, n, block_size)] for k, v in joined.items()}
        out["labels"] = [list(x) for x in out["input_ids"]]
        return out

    tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names)
    return tokenized.map(group_texts, batched=True)


def train(train_files, val_files, tokenizer_dir, out_dir, *, n_layer: int = 2, width: int = 64, n_head: int = 4,
          block_size: int = 128, batch_size: int = 16, max_steps: int = 240, epochs: float = 1.0,
          learning_rate: float = 3e-3, weight_decay: float = 0.0, save_steps: int = 80, seed: int = 0,
          tie_word_embeddings: bool = True) -> Path:
    """Train one GPT-Neo with ``transformers.Trainer``; returns its output folder."""
    from transformers import (AutoTokenizer, DataCollatorForLanguageModeling, GPTNeoConfig, GPTNeoForCausalLM,
                              Trainer, TrainingArguments, set_seed)

    set_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if tokenizer.pad_token is None:  # GPT-2 style tokenizers ship none; blocks are full-length anyway
        tokenizer.pad_token = tokenizer.eos_token
    data = lm_datasets(train_files, val_files, tokenizer, block_size)
    config = GPTNeoConfig(vocab_size=len(tokenizer), max_position_embeddings=block_size, hidden_size=width,
                          num_layers=n_layer, num_heads=n_head, attention_types=[[["global"], n_layer]],
                          intermediate_size=4 * width, tie_word_embeddings=tie_word_embeddings,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = GPTNeoForCausalLM(config)
    args = TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=batch_size, per_device_eval_batch_size=batch_size,
        max_steps=max_steps, num_train_epochs=epochs, learning_rate=learning_rate, weight_decay=weight_decay,
        warmup_steps=max(1, max_steps // 20) if max_steps > 0 else 0, lr_scheduler_type="cosine",
        eval_strategy="steps", eval_steps=save_steps, save_strategy="steps", save_steps=save_steps,
        logging_steps=save_steps, seed=seed, report_to=[], use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data["train"], eval_dataset=data["validation"],
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    trainer.train()
    trainer.save_model()
    tokenizer.save_pretrained(str(out_dir))
    metrics = trainer.evaluate()
    trainer.save_metrics("eval", metrics)
    return Path(out_dir)
