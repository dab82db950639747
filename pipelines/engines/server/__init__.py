"""The server engine (`--engine server --server-url URL ...`): the teacher runs behind vLLM's OpenAI-compatible
server (or any server that speaks its `/v1/completions` with `prompt_logprobs`), one or several replicas.

Each sample is one request: the prompt as token ids, `prompt_logprobs: K` (vLLM's extension) and one generated
token. The answer's per-position top-K (and the prompt token, added where it is outside them) is read straight
into arrays (`served_json`) and converted as the vLLM engine converts its own (`prompt_logprobs.entries_to_sparse`):
the same ids, log-probabilities, target and tail (1 - sum of the top-K) as `--engine vllm --vllm-output
logprobs`, then the torch engine's selection (`sparsify.to_samples`: top-k, or top-p cut from the K).

Before anything is written (`check`, through `preflight`): every replica answers `/v1/models` with the
teacher's model, tokenizes a probe text as the local tokenizer does (`/tokenize`, else the ids a text prompt
echoes), and takes K prompt log-probabilities (a larger K is refused naming `vllm serve --max-logprobs`; with
no --top-k/--top-p the build takes K = min(64, the server's maximum)).

The API key (`--server-api-key` or `LOGITSTORE_SERVER_API_KEY`) goes into each request's header and nowhere
else: not the settings' repr, the teacher's metadata, a message or a log line.
Rooms: `client.py` the transport (`Replicas`, the request pool, and the preflight's HTTP helpers),
`preflight.py` the checks before anything is written, `completions.py` what a request asks and what its answer
holds, `engine.py` the engine (`ServerEngine`) and the served generator (`ServerGenerator`).
"""
