"""The engine half of vime's backends (gloo, shm), loaded into vLLM workers by
`vime.weight_sync.vllm_extension`; imports no trainer code."""
