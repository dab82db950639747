"""Live mode: stage one's teacher beside stage two's trainer, handing its sparse distributions over by
shared memory (CUDA IPC on a GPU) instead of through a store. It uses both stages, so it lives above
both: `config.py` (`LiveConfig`, the flags of `train --live-teacher`), `teacher.py` (the teacher
process and the in-rank teacher of a served model) and `stream.py` (the stream the trainer reads).
"""
