"""Course mode: every chapter is also an assignment (student.py), graded chapter by chapter (grade.py)."""

from minifsdp.course.student import Exercise, find_exercises, strip_solutions, write_student_copy

__all__ = ["Exercise", "find_exercises", "strip_solutions", "write_student_copy"]
