"""The global model out of a run: open a checkpoint (a folder or a coordinator's URL), convert it to a
Hugging Face `LlamaForCausalLM` folder, or sample from it (`hetnode export`, `hetnode sample`)."""
