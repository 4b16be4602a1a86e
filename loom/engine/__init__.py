"""The engine: `LLMEngine.step()`, the async engine, the offline `LLM` API, sessions, outputs."""
