"""Prompts of the kinds users send, made from templates: math word problems, coding requests, writing requests
and everyday questions. They stand in for a prompt set where none is at hand, so that the trained tiny MoE
learns to route by what a request is about and `cohort compare` has requests of several kinds to admit.

Deterministic: the same `seed` and `per_kind` give the same prompts, in the same order (kinds interleaved).
"""

from __future__ import annotations

import random

NAMES = ["Ava", "Liam", "Noah", "Mia", "Zoe", "Omar", "Ines", "Kenji", "Priya", "Lucas", "Sara", "Tariq"]
ITEMS = ["apples", "pencils", "marbles", "cookies", "stickers", "books", "tickets", "shells", "coins", "cards"]
PLACES = ["the market", "school", "the fair", "the library", "the bakery", "the park"]
MATH = [
    "{a} has {x} {item}. {b} gives {a} {y} more, then {a} gives away {z}. How many {item} does {a} have now?",
    "A box holds {x} {item}. How many boxes are needed for {n} {item}? Show your reasoning step by step.",
    "{a} buys {x} {item} at {p} dollars each at {place} and pays with a {bill}-dollar bill. How much change?",
    "{a} reads {x} pages a day. How many days to finish a book of {n} pages? Explain each step.",
    "The price of {item} rose from {p} to {q} dollars. By what percentage did it rise? Round to one decimal.",
    "{a} and {b} share {n} {item} in the ratio {x}:{y}. How many does each get?",
]
TASKS = ["reverses a linked list", "checks whether a string is a palindrome", "merges two sorted arrays",
         "counts word frequencies in a text file", "finds the longest common prefix of a list of strings",
         "parses a CSV file into a list of dictionaries", "computes the nth Fibonacci number iteratively",
         "removes duplicates from a list while keeping order", "validates an email address with a regex",
         "implements binary search on a sorted list", "flattens a nested list", "rotates a matrix by 90 degrees"]
LANGS = ["Python", "JavaScript", "Rust", "Go", "Java", "C++"]
CODE = [
    "Write a {lang} function that {task}. Include type hints and a short docstring.",
    "Here is my {lang} code that {task}, but it fails on empty input. How do I fix it and add a unit test?",
    "Explain the time complexity of a {lang} function that {task}, then write an optimised version.",
    "Refactor this {lang} snippet that {task} into smaller functions and explain each change.",
]
FORMS = ["a short poem", "a limerick", "a cover letter", "a product description", "a wedding toast",
         "a bedtime story", "a blog post introduction", "a haiku sequence", "a persuasive essay", "a thank-you note"]
TOPICS = ["autumn in the mountains", "a new coffee shop", "friendship", "learning to swim", "a rainy city",
          "the first day at a job", "an old lighthouse", "a lost cat finding home", "the ocean at night"]
TONES = ["warm", "humorous", "formal", "melancholic", "upbeat", "nostalgic"]
WRITING = [
    "Write {form} about {topic} in a {tone} tone.",
    "Compose {form} about {topic}; keep it under 150 words and make it {tone}.",
    "Draft {form} on {topic} for my friend {a}, {tone} but not too long.",
]
SUBJECTS = ["photosynthesis", "inflation", "the French Revolution", "black holes", "vaccines", "compound interest",
            "the water cycle", "plate tectonics", "machine learning", "the Roman Empire", "sleep", "climate change"]
AUDIENCES = ["a ten-year-old", "a busy manager", "a first-year student", "my grandmother"]
QUESTIONS = [
    "Can you explain {subject} to {audience} in simple terms?",
    "What are the main causes and effects of {subject}? Give three examples.",
    "I am planning a trip to {place_city} next month. What should I pack and which sights should I see?",
    "What are some healthy habits for {audience} who wants to sleep better and feel less stressed?",
    "Compare the pros and cons of renting and buying a home for {audience}.",
    "Summarise what historians agree on about {subject}, and where they disagree.",
]
CITIES = ["Lisbon", "Kyoto", "Montreal", "Cape Town", "Oslo", "Buenos Aires", "Istanbul", "Hanoi"]
KINDS = {"math": MATH, "code": CODE, "chat": WRITING, "question": QUESTIONS}


def templated_prompts(per_kind: int = 400, seed: int = 0) -> list[tuple[str, str]]:
    """`per_kind` prompts of each kind as (kind, text), kinds interleaved; "question" is everyday chat."""
    rng = random.Random(seed)
    out = []
    for _ in range(per_kind):
        for kind, templates in KINDS.items():
            out.append((kind, rng.choice(templates).format(**_fill(rng))))
    return out


def _fill(rng: random.Random) -> dict[str, object]:
    a, b = rng.sample(NAMES, 2)
    x, y = rng.randint(2, 40), rng.randint(2, 40)
    return {"a": a, "b": b, "x": x, "y": y, "z": rng.randint(1, x), "n": rng.randint(50, 900),
            "p": rng.randint(2, 20), "q": rng.randint(21, 60), "bill": rng.choice([20, 50, 100]),
            "item": rng.choice(ITEMS), "place": rng.choice(PLACES), "task": rng.choice(TASKS),
            "lang": rng.choice(LANGS), "form": rng.choice(FORMS), "topic": rng.choice(TOPICS),
            "tone": rng.choice(TONES), "subject": rng.choice(SUBJECTS), "audience": rng.choice(AUDIENCES),
            "place_city": rng.choice(CITIES)}
