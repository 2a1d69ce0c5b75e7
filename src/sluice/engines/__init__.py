"""Engines: the only modules that import engine libraries (transformers today; vLLM and SGLang
later). ``hf_inference`` generates, ``hf_train`` trains, ``hf_model`` loads a model folder."""
