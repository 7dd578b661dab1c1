"""lamina inside the training frameworks people already use, built on the public API
(``lamina.init``, ``lamina.distribute``) like a user's own loop.
:mod:`lamina.integrations.lightning` is a Lightning strategy (Fabric and the Trainer);
:mod:`lamina.integrations.hf` runs a Hugging Face ``Trainer`` on lamina's strategies.
Each imports its framework only when imported itself (``pip install
"lamina-core[lightning]"`` or ``"lamina-core[hf]"``)."""
