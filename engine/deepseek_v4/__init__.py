"""DeepSeek-V4: the model family the store's design was made for (compressed block KV + window StateBlocks)."""
