"""A short built-in story (original text, CC0): the prompt of the examples and the notebook where no text is given
(`examples/*.py`, `examples/clusterkv_colab.ipynb`), and the tests' long text where the shared data is absent. The
demo writes its own document (`clusterkv_jax.demo.haystack`)."""

DEMO_DOCUMENT = """Title: The Keeper of Gull Rock
Author: Marta Lindqvist

Chapter 1

The lighthouse on Gull Rock had been kept by the Lindqvist family for three generations. Every evening at
dusk, Elsa climbed the one hundred and twelve steps of the tower, trimmed the wick, polished the great lens,
and wrote the weather in the log: the direction of the wind, the height of the swell, the ships that passed.

In the spring of the year the new steamer line opened, the log began to fill with names. The Aurora came on
Tuesdays with mail and flour; the Saint Brendan came on Fridays with coal. Elsa learned to tell them apart by
the colour of their smoke long before she could read the letters on their bows.

Chapter 2

One night in October a storm came in from the north-west. The lamp guttered twice and Elsa stayed beside it
until dawn, feeding it oil and wiping the salt from the glass. In the morning she found a small boat pulled up
on the shingle below the tower, and in it a boy who said his name was Tobias and that he had rowed from the
mainland to see the light up close.

Tobias stayed the winter. He learned the steps, the wick, the lens and the log. When the ice broke in March,
the Aurora took him home, and Elsa wrote in the log, under the weather, that the light had two keepers now.
"""
