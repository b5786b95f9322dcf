"""kvatlas.tokenize: a prompt as token ids, for the engine and the router alike.

Owns the tokenizer of an engine's ``--model`` loaded from its files (``loading``: no
transformers), its chat template as transformers renders it (``chat_template``), a GGUF
file's vocabulary (``gguf_vocab``), the second encoder that proves itself before use
(``fast_encoder``), and a request's prompt ids (``prompts``). Neither torch nor
transformers is imported here (an import contract checks it): ``kvatlas router
--tokenizer`` loads neither.
"""
