"""The load generator behind `llmserve bench` (the command keeps its name): a load of streamed requests against
llmserve's own API or any OpenAI-compatible server, timed token by token. Not the repository's benchmarks (bench/),
which use it."""
