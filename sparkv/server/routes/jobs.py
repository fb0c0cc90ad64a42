"""``GET /v1/jobs/{job_id}``: an encode job's state and progress."""

from __future__ import annotations

from anyio import to_thread
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from sparkv.server import schemas
from sparkv.server.deps import JobIdPath, StateDep, TenantDep
from sparkv.server.errors import ApiError
from sparkv.server.jobs import public_view
from sparkv.server.openapi import error_responses, operation_id

router = APIRouter(tags=["jobs"], generate_unique_id_function=operation_id)


@router.get("/v1/jobs/{job_id}", response_model=schemas.JobInfo, responses=error_responses(404))
async def get_job(job_id: JobIdPath, state: StateDep, tenant: TenantDep) -> JSONResponse:
    """The job's state, phase and progress (``Cache-Control: no-store``: poll it)."""
    rec = await to_thread.run_sync(state.jobs.get, tenant, job_id)
    if rec is None:
        raise ApiError(404, "job_not_found", f"no job {job_id}")
    return JSONResponse(public_view(rec), headers={"Cache-Control": "no-store"})
