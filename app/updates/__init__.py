"""The weight updates a server takes, for full weights and LoRA adapters alike: one control
(`control.WeightsControl`) over checkpoint loads and uploads (`service`), collective transfers
(`transfer`) and adapter pushes, for one server (`local`) or every replica of a deployment as
one (`app.deploy.replicated`). rlserve's weight routes (`router`), and vLLM's and SGLang's
(`app.dialects`), are vocabularies over it."""
