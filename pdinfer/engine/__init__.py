"""The step loop, the role hooks (LLMEngine), the PE/CE subclasses and the offline LLM API."""
