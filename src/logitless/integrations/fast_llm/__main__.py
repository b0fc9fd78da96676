"""``python -m logitless.integrations.fast_llm train gpt --config run.yaml``: Fast-LLM's own
command line (``fast-llm``), with ``head: {type: logitless}`` registered first (also under
``torchrun ... -m logitless.integrations.fast_llm``)."""

from logitless.integrations.fast_llm import main

if __name__ == "__main__":
    main()
