"""Course mode: every chapter is also an assignment (student.py), graded on the course's own tests with
only the code between the exercise markers taken from the submission (assemble.py, grade.py, report.py)."""

from minifsdp.course.student import Exercise, find_exercises, project_files, strip_solutions, write_student_copy

__all__ = ["Exercise", "find_exercises", "project_files", "strip_solutions", "write_student_copy"]
