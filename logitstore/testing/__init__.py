"""Test tooling that tests and benchmarks share: stores, teachers, prompts, synthetic data, the test servers
(an OpenAI-compatible teacher server, a fault-injecting S3 proxy) and the CLI run in-process (`cli.py`).
It sits above both stages: `cli.py` drives the command line and `teachers.py` uses stage one's teacher
loading, so nothing in the library, the stages or the CLI imports it."""
