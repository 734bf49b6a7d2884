"""A pytest plugin for the mutant test: the ``ci`` profile without shrinking.

Finding that a property fails is all that test needs; shrinking every failure would cost most of
its time. Load it with ``-p example_backend.hunt_profile --hypothesis-profile hunt``.
"""

from hypothesis import Phase, settings

from paged_sparse_attn.testing.profiles import register_profiles

register_profiles()
settings.register_profile("hunt", settings.get_profile("ci"), phases=[Phase.explicit, Phase.generate])
