"""Text and tokenizers: chat templates and loss masks, tokenizer files and hashes, Hub ids from the
local cache. Imports only the package's ground floor."""
