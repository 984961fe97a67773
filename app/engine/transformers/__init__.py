"""The transformers backend: a HuggingFace causal LM on one worker thread, with rlserve's own
decode loop (`decode`, sampling with `app.engine.sampling`), LoRA adapters per row (`lora`), routed
experts (`moe`) and pauses (`freeze`); and the reward model served beside the policy
(`reward`)."""
