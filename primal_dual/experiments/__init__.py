"""Task definitions (data + model + loss) registered with the trainer's task registry.

Each module registers one task on import; ``primal_dual.training.tasks.LAZY_TASK_MODULES`` maps
task names to these modules so that the trainer imports only what a config uses.
"""
