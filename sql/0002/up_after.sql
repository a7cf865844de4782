-- lockstep 0002 up, after the code: drop what 0001 had and 0002's code no longer uses, once the code has
-- replaced its users (0001's policies and lockstep.status read these; a policy depends on its functions).
-- locks: nothing beyond the catalogs.

-- rights judged by the role's name: 0002 judges them by oid (lockstep._may_manage_id and the like)
drop function if exists lockstep._state_gone(name);
drop function if exists lockstep._may_view(name);
drop function if exists lockstep._is_member(name);
drop function if exists lockstep._may_manage(name);
