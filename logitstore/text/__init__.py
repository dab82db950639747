"""Text and tokenizers: chat templates and loss masks, tokenizer files and hashes, Hub ids from the
local cache. Imports only the package's ground floor.

`TrainOn` is here, not in `chat.py`, so that what names a stream's options (`streaming/spec.py`) imports
no numpy: `import logitstore` stays light."""

from typing import Literal, get_args

# what a run on chat data supervises (`chat.py`): the completion only, or every token
TrainOn = Literal["completion", "prompt+completion"]
TRAIN_ON: tuple[TrainOn, ...] = get_args(TrainOn)
