"""reroll: RL post-training of language models.

Layers, top to bottom (DESIGN.md §2). A folder (or top-level module) is a layer; a module imports
only from its own layer or the layers below it, never above, not even inside a function, and the
layers import one another without a cycle. tests/test_layers.py reads the lines below and enforces
them; peers on one line may import each other, as long as no cycle forms.

    cli
    evaluation, check_model, pipelines
    rollout, workers
    distributed
    engines, training
    models
    envs, rewards, viewer, data, tracking
    sandbox, config, algorithms, settings
"""
__version__ = "0.1.0"
