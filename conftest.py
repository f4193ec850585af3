"""Hypothesis profiles for every test tree of the repository (tests/ and examples/*/tests/).

Select one with ``--hypothesis-profile=NAME``; ``python3 dev.py test`` passes ``ci``.
"""

from hypothesis import HealthCheck, Phase, settings

# "ci" is derandomized so CI is stable; "thorough" (python3 dev.py test --thorough) explores more.
settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
# "gpu": the "ci" examples without shrinking, so a failure on a lent GPU costs seconds, not minutes.
settings.register_profile("gpu", settings.get_profile("ci"), phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.register_profile(
    "thorough",
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
