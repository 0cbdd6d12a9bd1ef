"""Instructions for the real-model benchmark: training prompts (answered by the target to train drafters) and
held-out evaluation prompts by kind. No topic or phrasing of the open-ended evaluation prompts is in training."""

TRAIN_TOPICS = [
    "photosynthesis",
    "the water cycle",
    "volcanoes",
    "the French Revolution",
    "black holes",
    "vaccines",
    "compound interest",
    "machine learning",
    "the stock market",
    "climate change",
    "the immune system",
    "gravity",
    "electric cars",
    "the internet",
    "democracy",
    "coffee",
    "sleep",
    "the Roman Empire",
    "recycling",
    "earthquakes",
    "solar panels",
    "honey bees",
    "the moon landing",
    "chess",
    "bread baking",
    "meditation",
    "rainforests",
    "the printing press",
    "inflation",
    "antibiotics",
    "plate tectonics",
    "jazz music",
    "the human heart",
    "tides",
    "nuclear energy",
    "the Olympic Games",
    "DNA",
    "vitamins",
    "wind turbines",
    "the Great Wall of China",
    "ocean currents",
    "public speaking",
    "time management",
    "gardening",
    "running a marathon",
    "learning a language",
]
TRAIN_TEMPLATES = [
    "Explain {t} to a ten-year-old.",
    "What are the most important facts about {t}?",
    "Write a short paragraph about {t}.",
    "Give three interesting facts about {t}.",
    "Why does {t} matter? Answer in a few sentences.",
    "Describe the history of {t} briefly.",
    "What are common misconceptions about {t}?",
]
TRAIN_PROMPTS = [template.format(t=topic) for topic in TRAIN_TOPICS for template in TRAIN_TEMPLATES]

EVAL_PROMPTS = {
    "open": [
        "How do airplanes stay in the air?",
        "What should I pack for a weekend camping trip?",
        "Tell me how a refrigerator keeps food cold.",
        "What makes a good friend?",
        "How can I improve my handwriting?",
        "Why is the sky blue during the day and red at sunset?",
        "Suggest a plan for a rainy Sunday afternoon.",
        "How do glaciers form and move?",
    ],
    "summary": [
        "Summarize in two sentences: The city council met on Tuesday to discuss the new bicycle lanes. Residents "
        "spoke for and against the plan for over two hours. Supporters said the lanes would make streets safer for "
        "children, while shop owners worried about losing parking spaces. The council voted five to two to build "
        "the lanes on Main Street first and review the results after one year.",
        "Summarize this: Octopuses are soft-bodied animals with eight arms. They are known for their intelligence "
        "and can solve puzzles, open jars and escape from tanks. Their arms contain many neurons, so each arm can "
        "react on its own. Octopuses change colour and texture to hide from predators.",
    ],
    "code": [
        "Rename the function `calc` to `compute_total` in this code:\n```python\ndef calc(items):\n    total = 0\n"
        "    for item in items:\n        total += item.price * item.quantity\n    return total\n\n\n"
        "def report(items):\n    print('Total:', calc(items))\n    return calc(items)\n```",
        "Add type hints to this function:\n```python\ndef greet(name, times):\n    for _ in range(times):\n"
        "        print('Hello, ' + name)\n    return len(name) * times\n```",
    ],
    "extraction": [
        "List every person and city mentioned: Maria flew from Lisbon to Berlin to meet Tom, who had moved there "
        "from Chicago. Later they visited Anna in Vienna.",
        "Extract the dates from this text: The project started on 3 March 2021, the first release came on 15 June "
        "2022, and support ends on 31 December 2025.",
    ],
}
