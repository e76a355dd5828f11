"""kvbridge inside serving engines: `kvbridge.integrations.vllm` is a vLLM KV connector."""
